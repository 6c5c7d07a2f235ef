"""Objects of a storage copied into a local directory through the face (streamed, each byte
fetched once, DOWNLOADS_IN_FLIGHT objects at once), for train's loads of a run in a bucket
(`format/run_store.py`); the offline commands read a bucket in place (`stored_path`). The
directory must hold them all; that is checked first."""

from __future__ import annotations

import shutil
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from ...errors import UsageError
from ...sizes import format_size
from .face import Storage
from .local import LocalStorage

DOWNLOADS_IN_FLIGHT = 4  # objects at once, each a bounded stream


def download(storage: Storage, names: dict[str, int], directory: Path) -> None:
    """Objects `names` (name -> size) of `storage` as files under `directory`."""
    needed, free = sum(names.values()), shutil.disk_usage(directory).free
    if needed * 1.01 > free:
        raise UsageError(
            f"{storage.root}: reading it needs a local copy of {format_size(needed)}, and {directory} has {format_size(free)} free; "
            "point TMPDIR at a larger disk"
        )
    local = LocalStorage(directory)
    with ThreadPoolExecutor(DOWNLOADS_IN_FLIGHT, thread_name_prefix="fsdpkit-download") as pool:
        for _ in pool.map(lambda item: _copy(storage, local, *item), names.items()):
            pass


def _copy(storage: Storage, local: LocalStorage, name: str, size: int) -> None:
    with local.write(name) as stream:
        for _, block in storage.read_blocks(name, [(0, size)]):
            stream.write(block)
