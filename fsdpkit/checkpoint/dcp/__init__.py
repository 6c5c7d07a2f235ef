"""torch.distributed.checkpoint (DCP) directories, read and written without running anything
from them: FSDP2, FSDP1's SHARDED_STATE_DICT, torchtitan and accelerate checkpoints.

- unpickler  the allow-list for `.metadata`: DCP's metadata classes as inert records
- metadata   `.metadata` -> plain records: tensors, chunks, byte ranges, bytes items
- chunkdata  where a chunk's raw bytes lie in its file (torch_save archives, safetensors blobs)
- boxes      chunks as boxes: runs in the flat form, coverage (pure arithmetic)
- table      a DCP checkpoint as a table of `SourceTensor`s (what every command reads)
- layout     which keys are the model and which the optimizer, under fsdpkit's names
- inspect    inspect and verify reports
- export     DCP output (reshard, --to dcp); conversions from DCP live in checkpoint/offline
- writer     DCP output chunked as FSDP2 (no torch); pickler writes `.metadata`
"""
