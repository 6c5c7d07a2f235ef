"""DeepSpeed ZeRO checkpoints, read without DeepSpeed and without running anything from them.

- unpickler  the allow-list for a rank file's data.pkl: torch's tensor records and DeepSpeed's
             classes as inert records, by name (never imported)
- files      which files make a checkpoint: `latest`, the tag directory, the rank files
- rankfile   one rank file: its pickle, its storages as byte ranges, their CRC-32s
- flat       parameters as slices of the flat fp32 partitions, per ZeRO stage (arithmetic)
- table, sources   a checkpoint as a table of `SourceTensor`s (what every command reads)
- inspect    inspect and verify reports
- convert    --to full, as DeepSpeed's zero_to_fp32.py writes it
"""
