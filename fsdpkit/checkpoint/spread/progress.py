"""One progress count of every rank's bytes, shown by rank 0 only: each rank posts its count to
the process group's store (a few bytes every half second, never the data), rank 0 sums them in
a thread and shows the sum on stderr (fsdpkit/progress.py: a tqdm bar on a terminal, otherwise a
line every 10 s).
Each rank also posts the part it begins and that it finished, so that rank 0 can name a rank
that died or hangs, and its part, when the gather fails."""

from __future__ import annotations

import threading
import time

from ...progress import ByteProgress

POST_SECONDS = 0.5


class SharedCount:
    """This rank's byte count, posted to `store` (None: a run of one process), and on rank 0 the
    thread that shows the sum of every rank's."""

    def __init__(self, store, *, rank: int, world_size: int, key: str, show: ByteProgress | None, total: int):
        self.store, self.rank, self.world_size, self.key = store, rank, world_size, key
        self.show, self.total = show, total
        self.done, self.posted_at, self.shown = 0, 0.0, 0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        if self.show is not None:
            self.show(0, self.total)
        if self.store is not None and self.rank == 0 and self.show is not None:
            self._thread = threading.Thread(target=self._poll, daemon=True)
            self._thread.start()

    def add(self, nbytes: int) -> None:
        self.done += nbytes
        if self.store is None:
            if self.show is not None:
                self.show(nbytes, self.total)
            return
        if time.monotonic() - self.posted_at >= POST_SECONDS:
            self.post()

    def post(self) -> None:
        self.posted_at = time.monotonic()
        if self.store is not None:
            self.store.set(f"{self.key}/{self.rank}", str(self.done))

    def _poll(self) -> None:
        keys = [f"{self.key}/{rank}" for rank in range(self.world_size)]
        while not self._stop.wait(POST_SECONDS):
            self._show_sum(keys)
        self._show_sum(keys)

    def _show_sum(self, keys: list[str]) -> None:
        try:
            found = sum(int(self.store.get(key)) for key in keys if self.store.check([key]))
        except Exception:  # the store went away with a failed peer: the run reports that itself
            return
        if found > self.shown and self.show is not None:
            self.show(found - self.shown, self.total)
            self.shown = found

    def begin_part(self, label: str) -> None:
        """What this rank writes now, for the line that names a rank that stops answering."""
        if self.store is not None:
            self.store.set(f"{self.key}/part/{self.rank}", label)

    def finished(self) -> None:
        if self.store is not None:
            self.store.set(f"{self.key}/done/{self.rank}", "1")

    def unfinished(self) -> list[tuple[int, str]]:
        """(rank, the part it last began) of every rank that has not finished its parts."""
        found = []
        for rank in range(self.world_size):
            if not self.store.check([f"{self.key}/done/{rank}"]):
                part = f"{self.key}/part/{rank}"
                found.append((rank, self.store.get(part).decode() if self.store.check([part]) else ""))
        return found

    def stop(self) -> None:
        self.post()
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
