"""fsdpkit's own checkpoint format (docs/checkpoint-format.md), with no torch: shared by training
saves, the offline commands, DCP input and `diff`; the modules are listed in docs/development.md.
Nothing here imports torch or a package above it; importing this package imports nothing.
"""
