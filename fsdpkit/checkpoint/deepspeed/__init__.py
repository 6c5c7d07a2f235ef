"""DeepSpeed ZeRO checkpoints, read and written without DeepSpeed and without running anything
from them.

- unpickler  the allow-list for a rank file's data.pkl: torch's tensor records and DeepSpeed's
             classes as inert records, by name (never imported)
- files      which files make a checkpoint: `latest`, the tag directory, the rank files
- flat       parameters as slices of the flat fp32 partitions, per ZeRO stage (arithmetic)
- table, sources   a checkpoint as a table of `SourceTensor`s (what every command reads)
- inspect    inspect and verify reports
- convert    --to full, as DeepSpeed's zero_to_fp32.py writes it
- partition  how ZeRO 1/2/3 flatten, pad and cut each parameter group for N ranks (arithmetic)
- writer, writer_model, writer_zip, writer_records   rank files as DeepSpeed's save_checkpoint writes them
- writer_precision   what an fp32, bf16 or fp16 run changes in them
"""
