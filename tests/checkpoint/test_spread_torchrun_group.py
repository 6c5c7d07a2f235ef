"""A spread run under torchrun whose agent dies (torchrun SIGKILLed): the agent's store stops
answering, and each rank stops with one line that says so (not a traceback, not "another rank
stopped answering"), its parts kept for the same command again; gloo's own message of a lost peer
cut to what it says about the connection."""

from __future__ import annotations

import datetime
import gc

import pytest
import torch
import torch.distributed as dist
from support.checkpoint_files import run_cli, save_checkpoint

from fsdpkit.checkpoint.core.request import ConvertRequest
from fsdpkit.checkpoint.spread.runner import Solo, SpreadTask, run_ranks
from fsdpkit.checkpoint.spread.staging import staging_path
from fsdpkit.checkpoint.spread.torchrun_group import AgentStore, Group, StoreGone, short_reason
from fsdpkit.errors import RunError

GLOO_LOST_PEER = (
    "[/__w/pytorch/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:553] Connection closed by peer [127.0.0.1]:34183. "
    "This is typically caused by a remote worker crashing. Check the logs of the remote worker before reporting an error. GLHF! \U0001f3d6"
)


def _store_that_dies(rank: int = 0) -> tuple[AgentStore, str]:
    """A client of a real TCPStore whose server is then shut down, as torchrun's agent's is when it is killed."""
    server = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=datetime.timedelta(seconds=5))
    where = f"127.0.0.1:{server.port}"
    client = dist.TCPStore("127.0.0.1", server.port, is_master=False, timeout=datetime.timedelta(seconds=5))
    client.set("fsdpkit-spread/0", "0")
    del server
    gc.collect()
    return AgentStore(client, where, rank), where


class _AgentDied(Solo):
    def __init__(self, store: AgentStore):
        self.store = store


def test_a_run_whose_store_dies_stops_with_one_line_and_the_same_command_continues(tmp_path):
    g = torch.Generator().manual_seed(3)
    tensors = {f"layer.{i}.weight": torch.randn(64, 64, generator=g) for i in range(8)}
    save_checkpoint(tmp_path / "run", 1, tensors, world_size=2, training_state={"step": 1})
    request = ConvertRequest(to="full", max_shard_size=40_000)
    one = run_cli("convert", tmp_path / "run", tmp_path / "one", "--to", "full", "--max-shard-size", "40000")
    assert one.exit_code == 0, one.output
    task = SpreadTask("convert", str(tmp_path / "run"), str(tmp_path / "out"), request)
    store, where = _store_that_dies()
    with pytest.raises(StoreGone) as stopped:
        run_ranks(task, _AgentDied(store))
    line = str(stopped.value)
    assert line.startswith(f"rank 0: the run's store (torchrun's agent) at {where} stopped answering ("), line
    assert "\n" not in line and "run the same command again to continue" in line, line
    assert not (tmp_path / "out").exists() and staging_path(tmp_path / "out").exists()
    again = run_ranks(task, Solo())
    assert again is not None and not staging_path(tmp_path / "out").exists()
    written = {p.name: p.read_bytes() for p in (tmp_path / "out").iterdir()}
    assert written == {p.name: p.read_bytes() for p in (tmp_path / "one").iterdir()}


class _Gloo:
    """torch.distributed as a collective sees it once a peer's connection closed."""

    @staticmethod
    def all_gather_object(out, value):
        raise RuntimeError(GLOO_LOST_PEER)


def _group(store: AgentStore) -> Group:
    group = Group.__new__(Group)
    group.dist, group.rank, group.world_size, group.store = _Gloo(), 1, 2, store
    return group


class _Answers:
    def check(self, keys):
        return False


def test_a_lost_peer_is_named_by_what_died_in_one_short_line():
    assert short_reason(RuntimeError(GLOO_LOST_PEER)) == "Connection closed by peer [127.0.0.1]:34183"
    with pytest.raises(RunError) as peer:
        _group(AgentStore(_Answers(), "host:29500", 1)).all_gather("mine")
    assert not isinstance(peer.value, StoreGone)
    assert str(peer.value) == "rank 1: another rank stopped answering (Connection closed by peer [127.0.0.1]:34183)"
    store, where = _store_that_dies(rank=1)
    with pytest.raises(StoreGone) as agent:
        _group(store).all_gather("mine")
    assert str(agent.value).startswith(f"rank 1: the run's store (torchrun's agent) at {where} stopped answering ("), agent.value
