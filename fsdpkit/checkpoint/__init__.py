"""Sharded safetensors checkpoints: one typed core, used by training, convert, reshard, verify
and inspect alike. The format is specified in docs/checkpoint-format.md.

- format     names, constants, the dtype table, `optim.<state>.<param>` naming, bounded JSON
- placement  where every fragment lives, its file's header and size, derived (pure arithmetic)
- manifest   the manifest (v2; v1 read): schema, JSON round trip, validation; does it fit a model
- storage    finding checkpoints, paths kept inside them, atomic directories, `latest`, prune
- lock       one writer per run directory
- bytecopy   the one byte path: bounded reads with crc32 checks, float casts, crc arithmetic
- reader     the one reader of files: safetensors headers, sharded and full checkpoints
- writer     the one writer: streamed safetensors files, rank files, whole sharded outputs
- state      (torch) a sharded model and optimizer <-> fragments: Checkpointer, save, load
- background (torch) what keeps a save off the step: reused host buffers, thread priority, timings
- offline/   convert, reshard, verify, inspect: the offline commands (never import torch)

Importing this package imports nothing, so the offline commands never load torch through it.
"""
