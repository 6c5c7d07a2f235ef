"""fsdpkit's own checkpoint format (docs/checkpoint-format.md), with no torch: its names, placement,
manifest, reader and writer, run directories and the run lock, and its `Format`; full (Hugging Face
style) safetensors beside it, which share its reader and writer. The modules are listed in
docs/development.md. Nothing here imports torch or a package above it; importing this package
imports nothing.
"""
