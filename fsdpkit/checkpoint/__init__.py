"""Checkpoints: one table of named tensors in byte ranges, read and written in every format.

- core       what every format shares, no torch: `Format` (the protocol each format package
             implements), the tensor table and the byte engine, the any-format reader, the reports
- format     fsdpkit's own on-disk format (and full safetensors beside it), no torch: names,
             placement, manifest, the reader, the writer, run directories and the run lock
- dcp, deepspeed, torchsave   the other formats, each read (and written) without its library
- torchfile  torch's zip and pickle, shared by those three
- live       a live sharded model and its optimizer <-> a checkpoint (torch): `fsdpkit.save`,
             `fsdpkit.load`, `fsdpkit.Checkpointer`, the `CheckpointManager` of a run's directory
- memory     in-memory snapshots
- offline    the registry of formats and the offline commands over it: convert, reshard, diff

Importing this package imports nothing.
"""
