"""DeepSpeed ZeRO checkpoints, read and written without DeepSpeed and without running anything
from them."""
