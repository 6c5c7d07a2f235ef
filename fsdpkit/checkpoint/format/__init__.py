"""Sharded safetensors checkpoints on disk: one typed core, with no torch, used by training
saves (fsdpkit.checkpoint.live), the offline commands (fsdpkit.checkpoint.offline), DCP input (fsdpkit.checkpoint.dcp) and
`diff` alike. The format is specified in docs/checkpoint-format.md.

- format        names, constants, `optim.<state>.<param>` naming, bounded JSON, safetensors headers
- placement     where every fragment lives, its file's header and size, derived (pure arithmetic)
- manifest      the manifest (v2; v1 read): schema, JSON round trip, validation; does it fit a model
- storage       finding checkpoints, paths kept inside them, atomic directories, `latest`, prune
- lock          one writer per run directory
- files         opening a file without blocking, exact reads, vectored writes, mapped windows
- crc           crc32 arithmetic and float casts of raw bytes
- bytecopy      the one byte engine: every copy of byte ranges between files, checksums verified
- reader        the one reader of files: sharded and full checkpoints, validated
- writer        the one writer: streamed safetensors files, rank files, whole sharded outputs
- report        what `verify` reports of a checkpoint in any format
- export        how a model's checkpoint is handed to transformers (names, transposes, config)

Nothing here imports torch or a package above it; importing this package imports nothing.
"""
