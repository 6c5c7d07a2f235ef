"""fsdpkit's command-line interface (installed as the package `fsdpkit_cli`)."""
