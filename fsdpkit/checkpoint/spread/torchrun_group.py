"""The coordination of a spread run under torchrun: a gloo process group for the gathers, and
torchrun's agent's store for the progress count; when either stops answering, one line that says
which (`StoreGone` when the agent, and with it the store, went away: every rank says it itself, as
no agent is left to stop the others)."""

from __future__ import annotations

import re
from typing import Any

from ...errors import RunError

TORCH_SOURCE_PREFIX = re.compile(r"^\[[^\]]*\.(?:cc|cpp|h|hpp):\d+\]\s*")  # gloo's "[/.../pair.cc:553] "
ALIVE_KEY = "fsdpkit-spread/alive"  # asked of the store, never set: whether it answers


class StoreGone(RunError):
    """torchrun's agent (the run's store) stopped answering: each rank's own line."""


def short_reason(error: BaseException) -> str:
    """torch's message of `error`, without the C++ source it was raised at and its advice: gloo's
    "[.../pair.cc:553] Connection closed by peer [127.0.0.1]:34183. This is typically caused by
    ... GLHF!" is "Connection closed by peer [127.0.0.1]:34183"."""
    lines = str(error).strip().splitlines()
    first = TORCH_SOURCE_PREFIX.sub("", lines[0]) if lines else ""
    return first.split(". ")[0].rstrip(".") or type(error).__name__


class AgentStore:
    """torchrun's agent's store as the progress count uses it (set, get, check). Once it fails,
    every call raises the same `StoreGone` line without asking the store again."""

    def __init__(self, store: Any, where: str, rank: int):
        self.store, self.where, self.rank = store, where, rank
        self.lost: str | None = None

    def set(self, key: str, value: str) -> None:
        self._ask("set", key, value)

    def get(self, key: str) -> bytes:
        return self._ask("get", key)

    def check(self, keys: list[str]) -> bool:
        return self._ask("check", keys)

    def answers(self) -> bool:
        try:
            self.check([ALIVE_KEY])
        except StoreGone:
            return False
        return True

    def _ask(self, name: str, *args: Any) -> Any:
        if self.lost is None:
            try:
                return getattr(self.store, name)(*args)
            except RuntimeError as error:  # torch's DistNetworkError, DistStoreError: the agent is gone
                self.lost = (
                    f"rank {self.rank}: the run's store (torchrun's agent) at {self.where} stopped answering ({short_reason(error)})"
                )
        raise StoreGone(self.lost)


class Group:
    """The coordination of a run in a gloo process group (initialized by the caller), with the
    store of torchrun's agent."""

    def __init__(self, timeout: float):
        import datetime
        import os

        import torch.distributed as dist

        self.dist = dist
        self.rank, self.world_size = dist.get_rank(), dist.get_world_size()
        host, port = os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])
        store = dist.TCPStore(host, port, is_master=False, timeout=datetime.timedelta(seconds=timeout))
        self.store = AgentStore(store, f"{host}:{port}", self.rank)

    def broadcast(self, value: Any) -> Any:
        box = [value]
        self._call(self.dist.broadcast_object_list, box, src=0)
        return box[0]

    def all_gather(self, value: Any) -> list[Any]:
        out: list[Any] = [None] * self.world_size
        self._call(self.dist.all_gather_object, out, value)
        return out

    def _call(self, collective: Any, *args: Any, **kwargs: Any) -> None:
        try:
            collective(*args, **kwargs)
        except RuntimeError as error:  # a peer died or timed out: gloo says which connection, not which rank
            if not self.store.answers():  # torchrun's agent died: the peers stop as this rank does
                raise StoreGone(self.store.lost) from None
            raise RunError(f"rank {self.rank}: another rank stopped answering ({short_reason(error)})") from None
