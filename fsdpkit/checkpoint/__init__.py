"""Sharded safetensors checkpoints: one typed core, used by training, convert, reshard, verify
and inspect alike. The format is specified in docs/checkpoint-format.md.

No torch:
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
- export        how a model's checkpoint is handed to transformers (names, transposes, config)
- offline/      convert and reshard (convert.py), verify and inspect (verify.py)

torch:
- tensors       checkpoint bytes as torch tensors: dtype names, raw bytes, readers by element range
- model_state   a sharded model and its optimizer <-> the tensor table
- save_protocol every rank's part in a save: begin, agree, write, commit
- state         the Checkpointer, save, load, weights from a checkpoint, checks before launch
- background    what keeps an async save off the step

Importing this package imports nothing, so the offline commands never load torch through it.
"""
