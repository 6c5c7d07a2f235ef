"""Learning-rate schedules as pure functions of the step (so a resumed run continues exactly)."""

from __future__ import annotations

import math

MIN_LR_FRACTION = 0.1


def lr_at(step: int, *, base_lr: float, warmup_steps: int, total_steps: int, schedule: str) -> float:
    """The learning rate for optimizer step `step` (0-based): linear warmup, then constant or
    cosine decay to MIN_LR_FRACTION of base_lr at the last step."""
    if warmup_steps and step < warmup_steps:
        return base_lr * (step + 1) / warmup_steps
    if schedule == "constant":
        return base_lr
    decay_steps = max(1, total_steps - warmup_steps - 1)
    progress = min(1.0, (step - warmup_steps) / decay_steps)
    cosine = 0.5 * (1.0 + math.cos(math.pi * progress))
    return base_lr * (MIN_LR_FRACTION + (1.0 - MIN_LR_FRACTION) * cosine)
