"""Rank 0's hub, which coordinates a spread run on one node without torch: every rank gets every
rank's value and rank 0's broadcast, the workers' posts reach rank 0's store; a rank still
posting its progress is waited for however long it takes, a silent one is named once the
timeout passes, and one whose process exited is named with how it exited."""

from __future__ import annotations

import re
import subprocess
import sys
import threading
import time

import pytest

from fsdpkit.checkpoint.spread.hub import Hub, HubClient, shared_key
from fsdpkit.errors import RunError


def _worker(hub: Hub, rank: int, body, out: dict) -> threading.Thread:
    def run() -> None:
        client = HubClient(hub.address, hub.key, rank, hub.world_size)
        try:
            out[rank] = body(client)
        except RunError as error:
            out[rank] = error

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread


def test_every_rank_gets_every_value_and_the_posts_reach_rank_0():
    hub = Hub(3, 30.0, task={"command": "convert"})
    out: dict = {}

    def body(client: HubClient):
        header = client.broadcast(None)
        client.store.set(f"count/{client.rank}", str(10 * client.rank))
        return client.task, header, client.all_gather(client.rank * 2), client.store.check(["count/0"])

    threads = [_worker(hub, rank, body, out) for rank in (1, 2)]
    assert hub.broadcast("plan") == "plan"
    hub.store.set("count/0", "0")
    assert hub.all_gather(0) == [0, 2, 4]
    for thread in threads:
        thread.join(10)
    assert out[1] == ({"command": "convert"}, "plan", [0, 2, 4], True) and out[2][2] == [0, 2, 4]
    assert int(hub.store.get("count/2")) == 20
    hub.close()


def test_rank_0_shows_the_sum_of_every_ranks_count():
    """Rank 1's count, posted to rank 0's store, and rank 0's own: the bar rank 0 shows, against
    the run's total, ends at their sum."""
    from fsdpkit.checkpoint.spread.hub import KeyStore
    from fsdpkit.checkpoint.spread.progress import SharedCount

    store, shown = KeyStore(), []
    lead = SharedCount(store, rank=0, world_size=2, key="count", show=lambda done, total: shown.append((done, total)), total=1000)
    worker = SharedCount(store, rank=1, world_size=2, key="count", show=None, total=1000)
    lead.start()
    worker.add(700)
    worker.stop()
    lead.add(300)
    lead.stop()
    assert shown[0] == (0, 1000) and {total for _, total in shown} == {1000}, shown
    assert sum(done for done, _ in shown) == 1000, shown


def test_the_workers_learn_whether_rank_0_hands_them_the_job_and_an_answer_that_does_not_pickle_fails_at_once():
    hub = Hub(2, 30.0, task="task", hands_job=True)
    out: dict = {}
    told: dict = {}

    def body(client: HubClient):
        told["hands_job"] = client.hands_job
        return client.broadcast(None)

    thread = _worker(hub, 1, body, out)
    hub.broadcast(lambda: None)  # rank 0 goes on; its value cannot be sent to the worker
    thread.join(10)
    assert told == {"hands_job": True}
    assert isinstance(out.get(1), RunError) and "rank 0 could not send its answer" in str(out[1]), out
    hub.close()


def test_a_rank_still_posting_its_progress_is_waited_for_past_the_timeout():
    hub = Hub(2, 0.5, task=None)
    out: dict = {}

    def slow(client: HubClient):
        for step in range(12):  # 1.2 s of work, posting every 0.1 s: more than twice the timeout
            client.store.set("count/1", str(step))
            time.sleep(0.1)
        return client.all_gather("done")

    thread = _worker(hub, 1, slow, out)
    assert hub.all_gather("rank 0 done") == ["rank 0 done", "done"]
    thread.join(10)
    hub.close()


def test_a_silent_rank_is_named_once_the_timeout_passes():
    hub = Hub(2, 0.3, task=None)
    _worker(hub, 1, lambda client: time.sleep(5), {})
    with pytest.raises(RunError, match=r"^rank 1 did not answer within --timeout 0.3 s$"):
        hub.all_gather(None)
    hub.close()


def test_a_rank_whose_process_exited_is_named():
    hub = Hub(3, 30.0, task=None)
    hub.processes[2] = subprocess.Popen([sys.executable, "-c", "import sys; sys.exit(3)"])
    out: dict = {}
    _worker(hub, 1, lambda client: client.all_gather("one"), out)
    with pytest.raises(RunError, match=r"^worker rank 2 exited with code 3 before it joined$"):
        hub.all_gather("zero")
    deadline = time.monotonic() + 10
    while 1 not in out and time.monotonic() < deadline:
        time.sleep(0.05)
    assert isinstance(out[1], RunError) and "worker rank 2 exited with code 3 before it joined" in str(
        out[1]
    )  # the worker's gather fails too
    hub.close()


def test_once_a_gather_fails_every_gather_names_the_same_rank_not_a_worker_that_exited_because_of_it():
    """Rank 2 never joins: rank 1's gather fails first, naming it, and rank 1's process exits as a
    worker's does; rank 0's gather, of a later round, still names rank 2 (not rank 1's exit)."""
    hub = Hub(3, 0.5, task=None)
    client = HubClient(hub.address, hub.key, 1, 3)
    hub.broadcast("plan")
    with pytest.raises(RunError, match=r"^rank 2 did not join within --timeout 0.5 s$"):
        client.broadcast(None)
    client.close()
    exited = subprocess.Popen([sys.executable, "-c", "raise SystemExit(1)"])
    exited.wait()
    hub.processes[1] = exited
    with pytest.raises(RunError, match=r"^rank 2 did not join within --timeout 0.5 s$"):
        hub.all_gather("views")
    hub.close()


def test_across_nodes_a_rank_with_another_key_or_rank_is_refused_and_named(capsys, caplog):
    """Across nodes the key is derived from the run: a node started with another command gets
    another key and is refused (both sides say so, rank 0 at once); a rank given twice is refused at join."""
    import socket

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    hub = Hub(3, 0.5, task="task", listen=("", port), key=shared_key("127.0.0.1", str(port), "3", "convert A B"))
    address = ("127.0.0.1", port)
    with pytest.raises(RunError, match=r"^rank 1: rank 0 at 127.0.0.1:\d+ refused this node's key: every node must run the same command"):
        HubClient(address, shared_key("127.0.0.1", str(port), "3", "convert A C"), 1, 3, timeout=5)
    said, deadline = "", time.monotonic() + 10  # the hub's thread says it as it refuses; the refused rank may hear first
    while "refused a connection" not in said and time.monotonic() < deadline:  # on stderr once the CLI set up fsdpkit's log
        said += capsys.readouterr().err + caplog.text
        time.sleep(0.05)
    assert "rank 0 refused a connection from 127.0.0.1 with another key: every node must run the same command" in said
    joined = HubClient(address, shared_key("127.0.0.1", str(port), "3", "convert A B"), 1, 3, timeout=5)
    assert joined.task == "task"
    with pytest.raises(RunError, match=r"^rank 1 joined twice or is outside 1..2: give each node its own --node-rank$"):
        HubClient(address, hub.key, 1, 3, timeout=5)
    with pytest.raises(RunError, match=r"^rank 2 counts 4 ranks, rank 0 3"):
        HubClient(address, hub.key, 2, 4, timeout=5)
    with pytest.raises(
        RunError, match=r"^rank \d did not answer within --timeout 0.5 s \(refused connections from 127.0.0.1 with another key\)$"
    ):
        hub.all_gather(None)
    hub.close()


def test_a_worker_waits_for_a_rank_0_that_starts_later():
    import socket

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    key = shared_key("later")
    out: dict = {}
    thread = threading.Thread(target=lambda: out.setdefault(1, HubClient(("127.0.0.1", port), key, 1, 2, timeout=20).broadcast(None)))
    thread.start()
    time.sleep(0.5)
    hub = Hub(2, 20.0, task=None, listen=("", port), key=key)
    hub.broadcast("plan")
    thread.join(20)
    assert out == {1: "plan"}
    hub.close()


def test_a_failed_gather_names_only_the_rank_that_left():
    """Other ranks still at work when one died are not named (they have not finished yet)."""
    from fsdpkit.checkpoint.spread.hub import RankGone
    from fsdpkit.checkpoint.spread.runner import _gather_naming_the_stopped

    class Comm:
        def all_gather(self, value):
            raise RankGone("worker rank 3 closed its connection (it exited, or its node went away)", 3)

    class Count:
        store = object()

        def unfinished(self):
            return [(1, "model-00002.safetensors"), (3, "model-00007.safetensors")]

    with pytest.raises(RunError, match=r"^rank 3 stopped while writing model-00007.safetensors \(it died"):
        _gather_naming_the_stopped(Comm(), Count(), None)


def test_a_workers_connection_sends_its_small_messages_without_delay():
    """Nagle's algorithm off on a worker's side: its join follows the handshake's last message
    at once (not after the hub's delayed ACK)."""
    import socket

    hub = Hub(2, 30.0, task="task")
    client = HubClient(hub.address, hub.key, 1, 2)
    with socket.fromfd(client.conn.fileno(), socket.AF_INET, socket.SOCK_STREAM) as sock:
        assert sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY)
    assert client.task == "task"
    client.close()
    hub.close()


def test_ranks_that_connect_all_at_once_all_join():
    """Sixteen ranks connecting in the same instant all join (a listener's queue of one drops most
    of them: their handshakes then wait on connections the hub never took)."""
    hub = Hub(17, 5.0, task="task")
    start = threading.Barrier(16)
    out: dict = {}

    def join(rank: int) -> None:
        start.wait()
        try:
            out[rank] = HubClient(hub.address, hub.key, rank, 17, timeout=5).all_gather(rank)
        except RunError as error:
            out[rank] = error

    threads = [threading.Thread(target=join, args=(rank,), daemon=True) for rank in range(1, 17)]
    for thread in threads:
        thread.start()
    assert hub.all_gather(0) == list(range(17))
    for thread in threads:
        thread.join(10)
    assert out == {rank: list(range(17)) for rank in range(1, 17)}
    hub.close()


def test_a_peer_that_connects_and_says_nothing_keeps_no_rank_out_and_is_cut_off_at_the_timeout():
    import socket

    hub = Hub(2, 3.0, task="task")  # rank 1 joins within it even on a busy machine
    silent = [socket.create_connection(hub.address) for _ in range(3)]
    out: dict = {}
    thread = threading.Thread(target=lambda: out.setdefault(1, HubClient(hub.address, hub.key, 1, 2, timeout=5).all_gather(1)), daemon=True)
    thread.start()
    assert hub.all_gather(0) == [0, 1]
    thread.join(10)
    assert out == {1: [0, 1]}
    for peer in silent:
        peer.settimeout(10)
        while peer.recv(4096):  # the hub's challenge, then the end of the connection once its timeout passed
            pass
        peer.close()
    hub.close()


def test_a_rank_whose_handshake_does_not_finish_fails_within_its_timeout():
    """A rank 0 that takes the connection and never answers (the kernel's queue takes it; no one
    accepts it): the rank fails with its own line once its timeout passes, not never."""
    import socket

    from fsdpkit.checkpoint.spread.hub import JoinUnfinished

    with socket.create_server(("127.0.0.1", 0)) as mute:
        out: dict = {}

        def join() -> None:
            try:
                HubClient(mute.getsockname(), b"k" * 32, 1, 2, timeout=1)
            except RunError as error:
                out[1] = error

        thread = threading.Thread(target=join, daemon=True)
        thread.start()
        thread.join(10)
    assert isinstance(out.get(1), JoinUnfinished), out
    assert re.fullmatch(
        r"rank 1: rank 0 at 127\.0\.0\.1:\d+ took the connection but did not finish the handshake within --timeout 1 s", str(out[1])
    )
