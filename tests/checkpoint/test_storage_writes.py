"""Writes to object storage interrupted, against moto's S3 server through the real CLI: a
`reshard ... s3://` SIGKILLed while the proxy holds one of its uploads leaves no commit object,
`inspect` of the prefix finds no checkpoint, and the same command run again succeeds without
--overwrite and writes, object for object, what the command writes to a local directory."""

from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest
from support.checkpoint_files import run_cli, sample_optimizer, sample_tensors, save_checkpoint
from support.fault_proxy import FaultProxy
from support.object_store import s3_client

FSDPKIT = str(Path(sys.executable).with_name("fsdpkit"))
UNFINISHED = "no checkpoint yet: .fsdpkit-writing says an fsdpkit write is under way here, or was cut short (no commit object)"


def _objects(endpoint: str, bucket: str, prefix: str) -> dict[str, bytes]:
    client = s3_client(endpoint)
    listed = client.list_objects_v2(Bucket=bucket, Prefix=f"{prefix}/").get("Contents", [])
    return {item["Key"][len(prefix) + 1 :]: client.get_object(Bucket=bucket, Key=item["Key"])["Body"].read() for item in listed}


def test_a_reshard_killed_mid_upload_commits_nothing_and_runs_again(s3_bucket, s3_endpoint, tmp_path):
    params = sample_tensors()
    run = tmp_path / "run"
    save_checkpoint(run, 1, {**params, **sample_optimizer(params)}, world_size=2)
    url = f"s3://{s3_bucket}/out"
    command = [FSDPKIT, "reshard", str(run), url, "--world-size", "3"]
    with FaultProxy(s3_endpoint, fraction=1.0, kinds=("hold",), methods=("PUT", "POST"), only="out/rank-00001") as proxy:
        env = {**os.environ, "AWS_ENDPOINT_URL": proxy.url}
        killed = subprocess.Popen(
            command, env=env, cwd=tmp_path, start_new_session=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
        )
        try:
            assert proxy.held.wait(60), "the upload of rank 1's file never started"
        finally:
            os.killpg(killed.pid, signal.SIGKILL)
            killed.wait()
    left = _objects(s3_endpoint, s3_bucket, "out")
    assert "manifest.json" not in left and left  # something went up, not the commit object
    for command in ("inspect", "verify"):  # what a reader is told of a write under way or cut short
        result = run_cli(command, url)
        assert result.exit_code == 2 and result.output == f"error: {url}: {UNFINISHED}\n", result.output
    assert run_cli("reshard", str(run), url, "--world-size", "3").exit_code == 0  # no --overwrite needed
    assert run_cli("reshard", str(run), str(tmp_path / "local"), "--world-size", "3").exit_code == 0
    local = {
        path.relative_to(tmp_path / "local").as_posix(): path.read_bytes() for path in (tmp_path / "local").rglob("*") if path.is_file()
    }
    assert _objects(s3_endpoint, s3_bucket, "out") == local
    assert s3_client(s3_endpoint).list_multipart_uploads(Bucket=s3_bucket).get("Uploads", []) == []
    again = run_cli("reshard", str(run), url, "--world-size", "3")
    assert again.exit_code == 2 and "pass --overwrite" in again.output  # a whole checkpoint is never replaced unasked


def test_the_lock_of_a_run_in_a_bucket_is_one_conditional_create(s3_bucket, s3_endpoint):
    from fsdpkit.checkpoint.format.lock import RunLock
    from fsdpkit.errors import UsageError

    url = f"s3://{s3_bucket}/runs/locked"
    first = RunLock.acquire(url, run_id="run-a")
    with pytest.raises(UsageError, match=f"{url} is in use by another run: pid {os.getpid()} on .* \\(run run-a\\) holds {url}/.lock"):
        RunLock.acquire(url, run_id="run-b")  # this process is alive: never taken over
    first.release()
    assert _objects(s3_endpoint, s3_bucket, "runs/locked") == {}
    with RunLock.acquire(url, run_id="run-b") as second:
        assert second.run_id == "run-b" and b'"run": "run-b"' in _objects(s3_endpoint, s3_bucket, "runs/locked")[".lock"]


def test_the_writers_lease_on_a_bucket_destination_refuses_a_live_holder_and_takes_a_gone_ones(
    s3_bucket, s3_endpoint, tmp_path, monkeypatch
):
    """The marker of a write under way is the writer's lease, against the server: made once
    (a second take, a check of the destination and a publish are refused naming the holder,
    nothing written), rewritten at each beat, emptied by a writer that stopped (then taken at
    once); a holder on another host is refused while its marker changes and taken over once it
    stops changing, or once it is removed while it is watched; a killed holder on this host is
    taken over at once. A convert written into a local directory first (a full export --to
    sharded) holds the lease while it does."""
    import json
    import socket
    import threading

    from fsdpkit.checkpoint.storage import lease
    from fsdpkit.checkpoint.storage.lease import WRITING_MARKER, WriterLease
    from fsdpkit.checkpoint.storage.location import open_storage
    from fsdpkit.checkpoint.storage.upload import check_destination, claim_destination
    from fsdpkit.errors import UsageError

    url = f"s3://{s3_bucket}/out"
    storage = open_storage(url)
    held = (
        f"destination {url} is being written by another fsdpkit command \\(pid {os.getpid()} on {socket.gethostname()} "
        f"holds {url}/{WRITING_MARKER}\\): wait for it to finish; nothing written"
    )
    first = WriterLease.take(storage, beat_seconds=0.05)
    marker = _objects(s3_endpoint, s3_bucket, "out")[WRITING_MARKER]
    for refused in (
        lambda: WriterLease.take(storage),
        lambda: check_destination(storage, overwrite=True),
        lambda: claim_destination(storage, overwrite=True),
    ):
        with pytest.raises(UsageError, match=held):
            refused()
    assert list(_objects(s3_endpoint, s3_bucket, "out")) == [WRITING_MARKER]
    for _ in range(1000):  # the refusals may all end within one beat: the next, 10 s at most
        if json.loads(_objects(s3_endpoint, s3_bucket, "out")[WRITING_MARKER])["beat"] > json.loads(marker)["beat"]:
            break
        time.sleep(0.01)
    else:
        raise AssertionError(f"the holder never rewrote {WRITING_MARKER}")
    first.release(interrupted=True)
    assert _objects(s3_endpoint, s3_bucket, "out") == {WRITING_MARKER: b""}  # what a stopped write leaves: no holder
    WriterLease.take(storage).release(interrupted=False)
    assert _objects(s3_endpoint, s3_bucket, "out") == {}

    elsewhere = {"host": "another-node", "pid": 1, "started": "1", "lease": "theirs", "beat_seconds": 0.2, "beat": 0}
    beating = threading.Event()

    def beat() -> None:  # the holder on another host, alive: its marker changes at each beat
        while not beating.wait(0.05):
            elsewhere["beat"] += 1
            storage.put(WRITING_MARKER, json.dumps(elsewhere).encode())

    storage.put(WRITING_MARKER, json.dumps(elsewhere).encode())
    thread = threading.Thread(target=beat)
    thread.start()
    try:
        with pytest.raises(UsageError, match=f"pid 1 on another-node holds {url}/{WRITING_MARKER}"):
            WriterLease.take(storage)
    finally:
        beating.set()
        thread.join()
    watched, holder_lives = [], lease._holder_lives
    monkeypatch.setattr(lease, "_holder_lives", lambda storage, found: watched.append(found["lease"]) or holder_lives(storage, found))
    taken, existing = claim_destination(storage, overwrite=False)  # its beats stopped for 3 of them: gone, watched once
    assert watched == ["theirs"] and list(existing) == [WRITING_MARKER], (watched, existing)  # what it left: an interrupted write
    assert json.loads(_objects(s3_endpoint, s3_bucket, "out")[WRITING_MARKER])["lease"] == taken.holder["lease"]
    taken.release(interrupted=True)
    monkeypatch.setattr(lease, "_holder_lives", holder_lives)
    storage.put(WRITING_MARKER, json.dumps({**elsewhere, "beat_seconds": 2.0}).encode())
    released = threading.Timer(0.5, storage.delete, [[WRITING_MARKER]])  # the holder stops while its marker is watched
    released.start()
    try:
        with WriterLease.take(storage) as taken:
            assert json.loads(_objects(s3_endpoint, s3_bucket, "out")[WRITING_MARKER])["lease"] == taken.holder["lease"]
    finally:
        released.join()

    killed = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        from fsdpkit.holder import process_identity

        here = {**process_identity(), "pid": killed.pid, "lease": "killed", "beat_seconds": 60.0, "beat": 0}
        here["started"] = Path(f"/proc/{killed.pid}/stat").read_bytes().rsplit(b")", 1)[1].split()[19].decode()
        storage.put(WRITING_MARKER, json.dumps(here).encode())
        with pytest.raises(UsageError, match=f"pid {killed.pid} on "):
            WriterLease.take(storage)
        killed.kill()
        os.waitid(os.P_PID, killed.pid, os.WEXITED | os.WNOWAIT)  # dead, not yet reaped by its parent (a zombie)
        WriterLease.take(storage).release(interrupted=False)  # its process is gone: taken at once
    finally:
        killed.kill()
        killed.wait()
    assert _objects(s3_endpoint, s3_bucket, "out") == {}

    from fsdpkit.checkpoint.offline import formats
    from fsdpkit.models.source import resolve

    model = resolve("gpt-tiny")
    weights = {k: v for k, v in model.build(seed=0).state_dict().items() if k != "lm_head.weight"}
    state = {"step": 1, "export": model.export.to_json()}
    run = save_checkpoint(tmp_path / "run", 1, weights, world_size=1, aliases={"lm_head.weight": "wte.weight"}, training_state=state)
    assert run_cli("convert", run, tmp_path / "hf", "--to", "full").exit_code == 0
    beside, convert_any = [], formats.convert_any

    def converted_locally(*args, **kwargs):  # a second command checks the destination while this one converts
        try:
            check_destination(storage, overwrite=True)
            beside.append("not refused")
        except UsageError as error:
            beside.append(str(error))
        return convert_any(*args, **kwargs)

    monkeypatch.setattr(formats, "convert_any", converted_locally)
    result = run_cli("convert", tmp_path / "hf", url, "--to", "sharded", "--world-size", "1")
    assert result.exit_code == 0 and len(beside) == 1 and re.fullmatch(held, beside[0]), (result.output, beside)
    assert sorted(_objects(s3_endpoint, s3_bucket, "out")) == ["manifest.json", "rank-00000-of-00001.safetensors"]


def _bytes_under(directory: Path) -> int:
    return sum(path.stat().st_size for path in directory.rglob("*") if path.is_file())


@pytest.mark.parametrize(
    ("command", "extra", "spooled", "commit"),
    [
        ("convert", ("--to", "full", "--with-optimizer"), False, "model.safetensors"),
        ("convert", ("--to", "dcp", "--world-size", "2"), False, ".metadata"),
        ("convert", ("--to", "deepspeed", "--stage", "3", "--world-size", "2"), False, "latest"),
        ("reshard", ("--world-size", "3"), True, "manifest.json"),
    ],
    ids=["full", "dcp", "deepspeed", "reshard"],
)
def test_output_to_a_bucket_streams_with_bounded_local_disk(s3_bucket, s3_endpoint, tmp_path, monkeypatch, command, extra, spooled, commit):
    """`convert`/`reshard` of a 12 MiB checkpoint (with its Adam moments) to a bucket: TMPDIR,
    sampled at every write into an upload, holds at most a few KiB (the commit-time files) where
    the format is written in offset order, and at most one rank file of fsdpkit's format (its
    header, holding the crc32s, goes in last), never the output; it is empty afterwards; the
    commit object is the last upload completed; and every object is byte for byte the file the
    same command writes to a local directory."""
    import torch

    import fsdpkit.checkpoint.storage.objects as objects

    generator = torch.Generator().manual_seed(0)
    params = {f"h.{i}.weight": torch.randn(512, 512, generator=generator) for i in range(4)}
    run = tmp_path / "run"
    save_checkpoint(run, 1, {**params, **sample_optimizer(params)}, world_size=2)
    scratch = tmp_path / "tmpdir"
    scratch.mkdir()
    monkeypatch.setenv("TMPDIR", str(scratch))
    monkeypatch.setattr(tempfile, "tempdir", None)
    peak, write = [0], objects._ObjectStream.write

    def sampled(self, data, /):
        peak[0] = max(peak[0], _bytes_under(scratch))
        return write(self, data)

    completed: list[str] = []
    upload = objects.ObjectStorage.write

    @contextlib.contextmanager
    def recorded(self, name):
        with upload(self, name) as stream:
            yield stream
        completed.append(name)

    monkeypatch.setattr(objects._ObjectStream, "write", sampled)
    monkeypatch.setattr(objects.ObjectStorage, "write", recorded)
    url = f"s3://{s3_bucket}/out/{command}-{extra[1]}"
    remote = run_cli(command, str(run), url, *extra, "--json")
    monkeypatch.undo()
    assert list(scratch.iterdir()) == []
    here = run_cli(command, str(run), str(tmp_path / "local"), *extra, "--json")
    assert remote.exit_code == here.exit_code == 0 and remote.stdout.replace(url, str(tmp_path / "local")) == here.stdout
    local = {p.relative_to(tmp_path / "local").as_posix(): p.read_bytes() for p in (tmp_path / "local").rglob("*") if p.is_file()}
    assert _objects(s3_endpoint, s3_bucket, url.split("/", 3)[3]) == local
    output, largest = sum(map(len, local.values())), max(map(len, local.values()))
    assert output > 12 << 20
    assert peak[0] <= (largest if spooled else 64 << 10), (peak[0], largest)
    assert sorted(completed) == sorted(local) and completed[-1] == commit, completed


@pytest.mark.parametrize("extra", [("--to", "full"), ("--to", "dcp", "--world-size", "2")], ids=["one-file", "dcp"])
def test_a_write_whose_lease_another_command_took_over_commits_nothing(s3_bucket, s3_endpoint, tmp_path, monkeypatch, extra):
    """`convert` into a bucket whose lease another command takes over as the write begins (this
    one's beats looked stopped): exit 1 in one line, no object of its own left (a full
    checkpoint's one file, the commit object, held open until then, aborted; DCP's `.metadata`
    never written), no multipart upload open, and the other command's marker as it made it."""
    import json

    from fsdpkit.checkpoint.spread import to_storage
    from fsdpkit.checkpoint.storage.lease import WRITING_MARKER

    run = save_checkpoint(tmp_path / "run", 1, sample_tensors(), world_size=2)
    url = f"s3://{s3_bucket}/taken-{extra[1]}"
    theirs = json.dumps({"host": "another-node", "pid": 1, "lease": "theirs", "beat_seconds": 5.0, "beat": 0}).encode()
    claim = to_storage.claim_destination

    def claimed_then_taken_over(storage, **options):
        claimed = claim(storage, **options)
        storage.put(WRITING_MARKER, theirs)
        return claimed

    monkeypatch.setattr(to_storage, "claim_destination", claimed_then_taken_over)
    result = run_cli("convert", run, url, *extra)
    assert result.exit_code == 1, result.output
    assert result.output.strip().splitlines()[-1] == (
        f"error: {url}/{WRITING_MARKER}: another fsdpkit command took the destination over while this one was stalled "
        "(its beats stopped for 3 of them); nothing committed"
    ), result.output
    assert _objects(s3_endpoint, s3_bucket, f"taken-{extra[1]}") == {WRITING_MARKER: theirs}
    assert s3_client(s3_endpoint).list_multipart_uploads(Bucket=s3_bucket).get("Uploads", []) == []


@pytest.mark.parametrize(
    ("extra", "failing"),
    [
        (("--to", "full"), "model.safetensors"),
        (("--to", "full", "--max-shard-size", "5MB"), "model-00003-of-00003.safetensors"),
    ],
    ids=["commit-file", "last-data-file"],
)
def test_a_streamed_upload_that_fails_commits_nothing_and_aborts(s3_bucket, s3_endpoint, tmp_path, monkeypatch, extra, failing):
    """`convert` to a bucket whose every part upload of one object fails (the multipart upload
    itself is created), the full checkpoint's one file (the commit object, held open) or the
    last of its shards (the others uploaded before it): exit 1 naming the object, no object left
    (those uploaded before it and the marker removed too), no multipart upload left open,
    nothing in TMPDIR. A Ctrl-C that lands as an upload completes (a data file's, the commit
    object's) leaves no object either, and the command runs again without --overwrite."""
    import torch

    import fsdpkit.checkpoint.storage.objects as objects

    generator = torch.Generator().manual_seed(0)
    run = tmp_path / "run"
    save_checkpoint(run, 1, {f"h.{i}.weight": torch.randn(1024, 1024, generator=generator) for i in range(3)}, world_size=2)
    monkeypatch.setattr(objects, "RETRIES", 1)
    scratch = tmp_path / "tmpdir"
    scratch.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(scratch))
    out = f"out-{len(extra)}"  # the cases share the bucket (its name is cut from the test's)
    url = f"s3://{s3_bucket}/{out}/failed"
    with FaultProxy(s3_endpoint, fraction=1.0, kinds=("503",), methods=("PUT",), only=f"{out}/failed/{failing}") as proxy:
        monkeypatch.setenv("AWS_ENDPOINT_URL", proxy.url)
        result = run_cli("convert", str(run), url, *extra)
    assert result.exit_code == 1, result.output
    assert result.output.startswith(f"error: {url}/{failing}: write failed after retries, nothing committed"), result.output
    assert _objects(s3_endpoint, s3_bucket, out) == {}
    assert s3_client(s3_endpoint).list_multipart_uploads(Bucket=s3_bucket).get("Uploads", []) == []
    assert list(scratch.iterdir()) == []

    monkeypatch.setenv("AWS_ENDPOINT_URL", s3_endpoint)
    upload = objects.ObjectStorage.write
    for cut in ("model-00001-of-00003.safetensors", "model.safetensors.index.json"):

        @contextlib.contextmanager
        def interrupted(self, name, cut=cut):  # Ctrl-C as the upload of `cut` completes (what waits longest)
            with upload(self, name) as stream:
                yield stream
            if name == cut:
                raise KeyboardInterrupt

        monkeypatch.setattr(objects.ObjectStorage, "write", interrupted)
        result = run_cli("convert", str(run), url, "--to", "full", "--max-shard-size", "1MB")
        assert result.exit_code == 130 and _objects(s3_endpoint, s3_bucket, out) == {}, (cut, result.output)
    monkeypatch.setattr(objects.ObjectStorage, "write", upload)
    assert run_cli("convert", str(run), url, "--to", "full", "--max-shard-size", "1MB").exit_code == 0


def test_reshard_of_dcp_and_deepspeed_and_megatron_output_to_a_bucket_are_the_local_bytes(s3_bucket, s3_endpoint, tmp_path):
    """The writers the commands stream through for these (DCP's and DeepSpeed's reshard, a tiny
    Llama from transformers `--to megatron`): every object is the file the same command writes
    to a local directory, and the report is the local one, the URL in place of the path; run
    again with --overwrite, the objects are the same (the new commit-time files kept). A full
    export in transformers' layout, converted --to dcp locally and then published, at 2 ranks
    and again at 1 with --overwrite: the objects are the 1-rank files (rank 1's removed)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from fsdpkit.models.source import resolve

    params = sample_tensors()
    save_checkpoint(tmp_path / "run", 1, {**params, **sample_optimizer(params)}, world_size=2)
    assert run_cli("convert", tmp_path / "run", tmp_path / "dcp", "--to", "dcp", "--world-size", "2").exit_code == 0
    assert run_cli("convert", tmp_path / "run", tmp_path / "deepspeed", "--to", "deepspeed", "--stage", "2").exit_code == 0
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2
    )
    LlamaForCausalLM(config).save_pretrained(tmp_path / "hf")
    for name, args in (
        ("dcp", ("reshard", tmp_path / "dcp")),
        ("deepspeed", ("reshard", tmp_path / "deepspeed")),
        ("megatron", ("convert", tmp_path / "hf")),
    ):
        extra = ("--to", "megatron") if name == "megatron" else ("--world-size", "3")
        url, local = f"s3://{s3_bucket}/out/{name}", tmp_path / f"local-{name}"
        remote = run_cli(*args, url, *extra, "--json")
        here = run_cli(*args, local, *extra, "--json")
        assert remote.exit_code == here.exit_code == 0, remote.output
        assert remote.stdout.replace(url, str(local)) == here.stdout
        files = {p.relative_to(local).as_posix(): p.read_bytes() for p in local.rglob("*") if p.is_file()}
        assert _objects(s3_endpoint, s3_bucket, f"out/{name}") == files, name
        again = run_cli(*args, url, *extra, "--overwrite")  # over itself: the new objects stay, every one
        assert again.exit_code == 0 and _objects(s3_endpoint, s3_bucket, f"out/{name}") == files, (name, again.output)
    source = resolve("gpt-tiny")  # its export in transformers' layout is converted --to dcp locally, then published
    weights = {k: v for k, v in source.build(seed=0).state_dict().items() if k != "lm_head.weight"}
    state = {"step": 1, "export": source.export.to_json()}
    save_checkpoint(tmp_path / "gpt", 1, weights, world_size=1, aliases={"lm_head.weight": "wte.weight"}, training_state=state)
    assert run_cli("convert", tmp_path / "gpt", tmp_path / "export", "--to", "full").exit_code == 0
    url, local = f"s3://{s3_bucket}/out/export", tmp_path / "local-export"
    assert run_cli("convert", tmp_path / "export", url, "--to", "dcp", "--world-size", "2").exit_code == 0
    assert run_cli("convert", tmp_path / "export", local, "--to", "dcp").exit_code == 0
    again = run_cli("convert", tmp_path / "export", url, "--to", "dcp", "--overwrite")
    files = {p.relative_to(local).as_posix(): p.read_bytes() for p in local.rglob("*") if p.is_file()}
    assert again.exit_code == 0 and _objects(s3_endpoint, s3_bucket, "out/export") == files, again.output  # rank 1's file gone
