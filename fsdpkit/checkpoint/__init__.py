"""Checkpoints: one table of named tensors in byte ranges, read and written in every format.

- format    the fsdpkit on-disk format, no torch: names, placement, manifest, the one reader,
            the one writer, the byte engine, atomic directories
- live      a live sharded model and its optimizer <-> a checkpoint (torch): `fsdpkit.save`,
            `fsdpkit.load`, `fsdpkit.Checkpointer`
- offline   the offline commands over any format: convert, reshard, verify, inspect, diff
- dcp       torch.distributed.checkpoint directories, read and written without running them

Importing this package imports nothing.
"""
