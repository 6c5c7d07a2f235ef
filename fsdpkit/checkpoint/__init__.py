"""Sharded safetensors checkpoints: format, save building blocks, loading, offline tools.

The format is specified in docs/checkpoint-format.md (version 1). Modules, torch-free unless
marked:

- format        names, constants, dtype table, `optim.<state>.<param>` naming
- plan          where each tensor's elements live at a world size (flat plan or even split)
- manifest      Manifest schema, JSON load/validate, `build_manifest`, `save_manifest`
- safetensors_io  validating header parser, `StreamingWriter` (header first, data streamed)
- paths         run dir / `latest` / step dir resolution, path safety
- sharded       `open_sharded`: manifest + every header, cross-checked
- writer (torch)  `write_rank_file`: one rank's fragments -> its file, with crc32s
- commit        `begin` / `commit` / `abort` / `prune`: atomic step dirs, `latest`, keep-last
- reader (torch)  `CheckpointReader.read_range`: partial reads, checksums verified
- compat        `check_compatible`: does a checkpoint fit a model
- streamcopy, cast, sharded_out, full, output: bounded-memory byte copies, float casts,
                writing sharded/full outputs, atomic output directories
- convert, reshard, verify, summary: the `fsdpkit convert|reshard|verify|inspect` commands

This package imports nothing on import, so the offline commands never load torch through it.
"""
