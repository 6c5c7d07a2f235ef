"""Test helpers that worker processes import by module: the distributed launcher, the reference
models and training loop, checkpoint files written by hand."""
