"""`fsdpkit reshard`: a sharded checkpoint of world size W -> the same checkpoint for M ranks.

Pure range arithmetic and byte copies (no torch): the manifest's placement (the
model's flat-parameter units, or an even split) is laid out again at M, every new fragment is
read from the overlapping old fragments in bounded memory (`--chunk-size`), old checksums are
verified as their bytes pass, new ones computed. Model and optimizer state both move; the
training state is kept except its `per_rank` part, dropped with a warning when M != W.
"""

from __future__ import annotations

from pathlib import Path

from ...errors import UsageError
from ..bytecopy import DEFAULT_CHUNK_SIZE
from ..manifest import resharded_training_state
from ..reader import open_sharded
from ..storage import staged_output
from ..writer import write_sharded
from .convert import Progress, _progress_callback


def reshard(
    src: str | Path,
    dst: str | Path,
    *,
    world_size: int,
    chunk_size: int = DEFAULT_CHUNK_SIZE,
    overwrite: bool = False,
    progress: Progress | None = None,
    warn=None,
) -> dict:
    if world_size < 1:
        raise UsageError(f"--world-size must be >= 1, got {world_size}")
    checkpoint = open_sharded(src)
    old = checkpoint.manifest
    state, warnings = resharded_training_state(old.training_state, old_world_size=old.world_size, new_world_size=world_size)
    for line in warnings:
        if warn is not None:
            warn(line)
    sources = checkpoint.sources()
    total = sum(s.nbytes for s in sources)
    needed_for = f" for {world_size} rank files (--world-size {world_size})"
    with staged_output(dst, src=Path(src), overwrite=overwrite, needed_bytes=total + world_size * 65536, needed_for=needed_for) as tmp:
        written = write_sharded(
            tmp,
            sources=sources,
            placement=old.placement,
            world_size=world_size,
            strategy=old.strategy,
            training_state=state,
            aliases=old.aliases,
            cast_to=None,
            chunk_size=chunk_size,
            progress=_progress_callback(progress, total),
        )
    return {
        "src": str(checkpoint.step_dir),
        "dst": str(dst),
        "from_world_size": old.world_size,
        "world_size": world_size,
        "placement": old.placement.kind,
        "files": written.files,
        "tensors": len(written.manifest.tensors),
        "bytes": written.bytes,
        "warnings": warnings,
    }
