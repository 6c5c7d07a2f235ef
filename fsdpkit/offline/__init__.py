"""The offline commands over fsdpkit checkpoints, built on fsdpkit.checkpoint: convert and
reshard (convert.py), verify and inspect (verify.py). Byte copies over fragments in bounded
memory; none of them imports torch."""
