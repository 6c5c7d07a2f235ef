"""torch.distributed.checkpoint (DCP) directories, read and written without running anything
from them: FSDP2, FSDP1's SHARDED_STATE_DICT, torchtitan and accelerate checkpoints."""
