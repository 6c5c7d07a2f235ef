"""Token data: tokenizers and flat token files (no torch, no process group)."""
