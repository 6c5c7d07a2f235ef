"""Writing a sharded checkpoint from `SourceTensor`s by range arithmetic (no torch).

Used by `convert --to sharded` (sources: a full checkpoint) and `reshard` (sources: another
sharded checkpoint). For each rank of the new world size, the ranges `plan.rank_contents`
assigns are copied through one `ByteCopier` (bounded memory, source checksums verified on
the way) into `rank-0000r-of-0000M.safetensors`, each fragment's crc32 computed from the
bytes written (`ByteCopier.copy(..., checksum=True)`); then `manifest.json`. Every rank
gets a file, possibly with no tensors.
"""

from __future__ import annotations

from pathlib import Path

from .format import output_dtype, rank_file_name
from .manifest import FileEntry, FragmentEntry, Manifest, TensorEntry, manifest_problems, save_manifest
from .plan import Plan, rank_contents
from .safetensors_io import StreamingWriter
from .streamcopy import ByteCopier, SourceTensor


def write_sharded(directory: Path, *, sources: list[SourceTensor], plan: Plan, world_size: int, strategy: str,
                  training_state: dict, aliases: dict[str, str], cast_to: str | None, copier: ByteCopier) -> Manifest:
    by_name = {source.name: source for source in sources}
    contents = rank_contents(plan, [(s.name, s.shape) for s in sources], world_size)
    fragments: dict[str, list[FragmentEntry]] = {source.name: [] for source in sources}
    files = []
    for rank in range(world_size):
        file_name = rank_file_name(rank, world_size)
        ranges = dict(contents[rank])
        entries = [(name, output_dtype(by_name[name].dtype, cast_to), (rng.size,)) for name, rng in contents[rank]]
        with StreamingWriter(directory / file_name, entries, metadata={"format": "pt"}, write_behind=True) as writer:
            for name, info in writer.order:
                crc = copier.copy(by_name[name], ranges[name], info.dtype, writer.write, checksum=True)
                rng = ranges[name]
                fragments[name].append(FragmentEntry(file_name, name, rng.start, rng.end, crc))
        files.append(FileEntry(file_name, writer.size))
    tensors = tuple(TensorEntry(s.name, s.shape, output_dtype(s.dtype, cast_to),
                                tuple(sorted(fragments[s.name], key=lambda f: f.start))) for s in sources)
    manifest = Manifest(world_size, strategy, plan, tuple(files), tensors, dict(aliases), dict(training_state))
    problems = manifest_problems(manifest)
    if problems:
        raise AssertionError(f"wrote an inconsistent manifest: {problems[0]}")
    copier.finish()
    save_manifest(directory, manifest)
    return manifest

