"""`fsdpkit train` saving to and resuming from object storage, through the real CLI against moto's
S3 server, 2 processes, gloo: a run saved to a bucket and resumed from there ends bitwise equal to
one uninterrupted local run (the oracle: the same run's local checkpoint, read back by boto3);
keep-last removes the old steps' objects; the lock is a conditional create; a save cut short by
SIGKILL mid-upload leaves no checkpoint that --resume would take; a write that fails after
retries names the object, exits 1 and commits nothing."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import pytest
import torch
from fsdpkit_cli.app import app
from support.fault_proxy import FaultProxy
from support.object_store import s3_client
from support.processes import kill_run, workers
from typer.testing import CliRunner

from fsdpkit.checkpoint.live.tensors import CheckpointReader

runner = CliRunner()
COMMON = ["--nproc-per-node", "2", "--seq-len", "32", "--global-batch-size", "8", "--lr-schedule", "cosine", "--warmup-steps", "2"]
FSDPKIT = str(Path(sys.executable).with_name("fsdpkit"))


def train(*args: str) -> dict:
    result = runner.invoke(app, ["train", *COMMON, *args, "--json"])
    assert result.exit_code == 0, result.output
    return json.loads(result.stdout)


def keys(endpoint: str, bucket: str, prefix: str) -> list[str]:
    found = s3_client(endpoint).list_objects_v2(Bucket=bucket, Prefix=f"{prefix}/").get("Contents", [])
    return sorted(item["Key"][len(prefix) + 1 :] for item in found)


def downloaded(endpoint: str, bucket: str, prefix: str, into: Path) -> Path:
    """The objects under `prefix`, fetched by boto3 (not fsdpkit) into `into`."""
    client = s3_client(endpoint)
    for key in keys(endpoint, bucket, prefix):
        (into / key).parent.mkdir(parents=True, exist_ok=True)
        client.download_file(bucket, f"{prefix}/{key}", str(into / key))
    return into


def weights(path: Path) -> dict[str, torch.Tensor]:
    with CheckpointReader(path) as reader:
        return {name: reader.read_tensor(name) for name in reader.tensor_names()}


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """Six steps, uninterrupted, saved locally every two."""
    root = tmp_path_factory.mktemp("reference")
    return train("--steps", "6", "--save-every", "2", "--save-dir", str(root / "run")), root / "run"


def test_a_save_killed_mid_upload_leaves_no_checkpoint_and_the_resume_from_the_bucket_ends_bitwise(
    reference, s3_bucket, s3_endpoint, tmp_path
):
    """The proxy holds the uploads of step 4's rank files; the whole run is SIGKILLed then. The
    resume (async saves, keep-last 1, the same run: it takes over the dead run's lock) reads the
    bucket in place (no file of the size of a rank file lands in TMPDIR) and ends bitwise equal
    to the uninterrupted local run."""
    full, local = reference
    url = f"s3://{s3_bucket}/runs/k"
    command = [FSDPKIT, "train", *COMMON, "--steps", "6", "--save-every", "2", "--save-dir", url, "--quiet"]
    with FaultProxy(s3_endpoint, fraction=1.0, kinds=("hold",), methods=("PUT", "POST"), only="step-00000004/rank-") as proxy:
        run = subprocess.Popen(command, env={**os.environ, "AWS_ENDPOINT_URL": proxy.url}, cwd=tmp_path, start_new_session=True)
        try:
            assert proxy.held.wait(120), "the save of step 4 never started"
        finally:
            kill_run(run.pid)
            run.wait()
    listed = keys(s3_endpoint, s3_bucket, "runs/k")
    assert [name for name in listed if name.endswith("manifest.json")] == ["step-00000002/manifest.json"]
    assert s3_client(s3_endpoint).get_object(Bucket=s3_bucket, Key="runs/k/latest")["Body"].read() == b"step-00000002\n"
    inspected = runner.invoke(app, ["inspect", url, "--json"])
    assert inspected.exit_code == 0 and json.loads(inspected.stdout)["path"] == f"{url}/step-00000002"
    temporary = Path(os.environ.get("TMPDIR") or tempfile.gettempdir())  # the session's, which the fork server's workers inherited
    stop, largest = threading.Event(), [0]
    watcher = threading.Thread(target=_watch_largest_file, args=(temporary, stop, largest, set(temporary.rglob("*"))))
    watcher.start()
    try:
        result = runner.invoke(app, ["train", "--resume", url, "--save-dir", url, "--async-save", "--keep-last", "1", "--json"])
    finally:
        stop.set()
        watcher.join()
    assert result.exit_code == 0, result.output
    rank_file_bytes = min(path.stat().st_size for path in (local / "step-00000002").glob("rank-*"))
    assert largest[0] < rank_file_bytes // 4, f"a file of {largest[0]} bytes in TMPDIR during the resume"
    assert "took over the lock" in result.stderr
    resumed = json.loads(result.stdout)
    assert resumed["resumed_from_step"] == 2 and resumed["losses"] == full["losses"][2:]
    assert resumed["checkpoint"] == f"{url}/step-00000006"
    mine, expected = weights(downloaded(s3_endpoint, s3_bucket, "runs/k", tmp_path / "copy")), weights(local / "step-00000006")
    assert mine.keys() == expected.keys() and all(torch.equal(mine[name], expected[name]) for name in expected)
    assert keys(s3_endpoint, s3_bucket, "runs/k") == [  # keep-last 1: the old steps' objects are gone, and the lock
        "latest",
        "step-00000006/manifest.json",
        *[f"step-00000006/rank-0000{rank}-of-00002.safetensors" for rank in range(2)],
    ]
    assert s3_client(s3_endpoint).list_multipart_uploads(Bucket=s3_bucket).get("Uploads", []) == []


SMALL = ["--model", "gpt-small", "--steps", "6", "--save-every", "2"]  # rank files of 19 MiB: 3 parts each
KILL_MOMENTS = (0, 1, 2, 3, 4, 6, 8, 9, 10, 11)  # of a save's 12 writes: 2 x (create, 3 parts, complete), the manifest, `latest`


@pytest.fixture(scope="module")
def small_reference(tmp_path_factory):
    """gpt-small, six steps, uninterrupted, saved locally every two."""
    root = tmp_path_factory.mktemp("small")
    return train(*SMALL, "--save-dir", str(root / "run")), root / "run"


def test_workers_killed_at_ten_moments_of_save_uploads_leave_no_upload_open_and_the_run_ends_bitwise(
    small_reference, s3_bucket, s3_endpoint, tmp_path
):
    """One run with --max-restarts 10; the proxy holds a save's writes from the k-th on, and both
    workers are SIGKILLed there, for 10 moments k: before, between and after the multipart uploads'
    parts, before the manifest, before `latest`. After each kill the bucket holds no step with a
    manifest whose rank files are not whole, and no upload the kill before left open (the
    restarted workers' next save aborted them: moto reports every upload as initiated in 2010, so
    the sweep's time bound is checked in test_storage_sigv4.py); the restarts resume from the bucket
    with nothing landing in TMPDIR; the run ends with no upload open, its losses and weights bitwise
    those of the uninterrupted local run."""
    full, local = small_reference
    url, client = f"s3://{s3_bucket}/runs/r", s3_client(s3_endpoint)
    # TMPDIR of the run, short: the launcher's sockets live there (AF_UNIX paths end at 108 bytes)
    scratch = Path(tempfile.mkdtemp(prefix="fsdpkit-kills-"))
    try:
        _kill_at_ten_moments(full, local, url, client, scratch, tmp_path, s3_endpoint, s3_bucket)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


def _kill_at_ten_moments(full, local, url, client, scratch: Path, tmp_path: Path, s3_endpoint: str, s3_bucket: str) -> None:
    command = [FSDPKIT, "train", *COMMON, *SMALL, "--save-dir", url, "--max-restarts", "10", "--quiet", "--json"]
    stop, largest = threading.Event(), [0]
    watcher = threading.Thread(target=_watch_largest_file, args=(scratch, stop, largest))
    watcher.start()
    left_open: set[str] = set()
    with FaultProxy(s3_endpoint, fraction=1.0, kinds=("hold",), methods=("PUT", "POST"), only=("/step-", "/latest")) as proxy:
        proxy.arm(KILL_MOMENTS[0])
        env = {**os.environ, "AWS_ENDPOINT_URL": proxy.url, "TMPDIR": str(scratch)}
        run = subprocess.Popen(command, env=env, cwd=tmp_path, start_new_session=True, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        try:
            for following in (*KILL_MOMENTS[1:], None):
                _wait_for_the_hold(proxy, run)
                _kill_workers(run.pid)
                uploads = {u["UploadId"] for u in client.list_multipart_uploads(Bucket=s3_bucket, Prefix="runs/r/").get("Uploads", [])}
                assert not uploads & left_open, "an upload a killed save left open outlived the next save"
                left_open = uploads
                _assert_no_half_checkpoint(client, s3_bucket, "runs/r/", local)
                proxy.release()
                if following is not None:
                    time.sleep(0.5)  # the killed workers' connections are closed
                    proxy.arm(following)
            out, err = run.communicate(timeout=300)
        finally:
            if run.poll() is None:
                kill_run(run.pid)
                run.wait()
            stop.set()
            watcher.join()
    assert run.returncode == 0, err.decode()
    summary = json.loads(out)
    assert summary["restarts"] == 10 and summary["losses"] == full["losses"]
    assert client.list_multipart_uploads(Bucket=s3_bucket, Prefix="runs/r/").get("Uploads", []) == []
    assert largest[0] < (1 << 20), f"a file of {largest[0]} bytes in TMPDIR during the run"
    mine, expected = weights(downloaded(s3_endpoint, s3_bucket, "runs/r", tmp_path / "copy")), weights(local / "step-00000006")
    assert mine.keys() == expected.keys() and all(torch.equal(mine[name], expected[name]) for name in expected)


def _wait_for_the_hold(proxy: FaultProxy, run: subprocess.Popen) -> None:
    """Until the proxy holds the armed write; the run's own error if it ended before that."""
    deadline = time.monotonic() + 300
    while not proxy.held.wait(1.0):
        if run.poll() is not None:
            said = [
                line for line in run.stderr.read().decode().splitlines() if not line.startswith((" ", "Traceback", "FileNotFoundError"))
            ]
            raise AssertionError(f"the run ended (exit {run.returncode}) before the armed write: {said[-20:]}")
        assert time.monotonic() < deadline, "no save reached the moment to kill it"


def _kill_workers(launcher: int) -> None:
    """SIGKILL every worker of the launcher at once, and wait until they are gone."""
    pids = workers(launcher)
    assert pids, "no workers to kill"
    for pid in pids:
        os.kill(pid, signal.SIGKILL)
    deadline = time.monotonic() + 30
    while any(os.path.exists(f"/proc/{pid}") and _state(pid) != "Z" for pid in pids) and time.monotonic() < deadline:
        time.sleep(0.02)


def _state(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return "Z"


def _assert_no_half_checkpoint(client, bucket: str, prefix: str, reference: Path) -> None:
    """Every step holding a manifest holds each rank file, at the size of the reference run's."""
    listed = {item["Key"][len(prefix) :]: item["Size"] for item in client.list_objects_v2(Bucket=bucket, Prefix=prefix).get("Contents", [])}
    for name in listed:
        if name.endswith("/manifest.json"):
            step = name.rpartition("/")[0]
            manifest = json.loads(client.get_object(Bucket=bucket, Key=f"{prefix}{name}")["Body"].read())
            files = {key: size for key, size in listed.items() if key.startswith(f"{step}/rank-")}
            assert len(files) == manifest["world_size"], (step, files)
            assert all(size == (reference / key).stat().st_size for key, size in files.items()), (step, files)


def _watch_largest_file(directory: Path, stop: threading.Event, largest: list[int], before: frozenset | set = frozenset()) -> None:
    """The size of the largest file under `directory` (but those `before`) until `stop`, into `largest[0]`."""
    while not stop.wait(0.02):
        for path in set(directory.rglob("*")) - before:
            try:
                largest[0] = max(largest[0], path.stat().st_size if path.is_file() else 0)
            except OSError:
                continue


def test_init_from_and_save_to_a_bucket_through_failing_requests_equal_the_same_run_on_disk(
    reference, s3_bucket, s3_endpoint, tmp_path, monkeypatch
):
    """5% of the requests fail (503, 500, dropped); the run from and to the bucket ends as the run
    from and to directories does: the same losses, and rank files byte for byte the same."""
    full, local = reference
    client = s3_client(s3_endpoint)
    for path in (local / "step-00000006").iterdir():  # put there by boto3
        client.upload_file(str(path), s3_bucket, f"ckpt/step-00000006/{path.name}")
    flags = ["--steps", "2", "--save-every", "2"]
    on_disk = train(*flags, "--init-from", str(local / "step-00000006"), "--save-dir", str(tmp_path / "out"))
    with FaultProxy(s3_endpoint, fraction=0.05, seed=3) as proxy:
        monkeypatch.setenv("AWS_ENDPOINT_URL", proxy.url)
        in_bucket = train(*flags, "--init-from", f"s3://{s3_bucket}/ckpt", "--save-dir", f"s3://{s3_bucket}/out")
    assert sum(proxy.faults.values()) > 0
    assert in_bucket["losses"] == on_disk["losses"] and in_bucket["losses"][0] != full["losses"][0]  # not the seed's weights
    rank_files = sorted(path.name for path in (tmp_path / "out" / "step-00000002").glob("rank-*"))
    assert len(rank_files) == 2
    for name in rank_files:
        stored = client.get_object(Bucket=s3_bucket, Key=f"out/step-00000002/{name}")["Body"].read()
        assert stored == (tmp_path / "out" / "step-00000002" / name).read_bytes(), name


def test_a_save_that_fails_after_retries_names_the_object_exits_1_and_commits_nothing(s3_bucket, s3_endpoint, tmp_path, monkeypatch):
    url = f"s3://{s3_bucket}/runs/f"
    with FaultProxy(s3_endpoint, fraction=1.0, kinds=("400",), methods=("PUT", "POST"), only="step-00000002/rank-00001") as proxy:
        monkeypatch.setenv("AWS_ENDPOINT_URL", proxy.url)
        result = runner.invoke(app, ["train", *COMMON, "--steps", "2", "--save-every", "2", "--save-dir", url])
    assert result.exit_code == 1, result.output
    said = result.output.strip().splitlines()[-1]
    assert f"{url}/step-00000002/rank-00001-of-00002.safetensors: write failed after retries, nothing committed: HTTP 400" in said, said
    assert [name for name in keys(s3_endpoint, s3_bucket, "runs/f") if name.endswith(("manifest.json", "latest"))] == []


def test_a_truncated_rank_file_in_the_bucket_is_exit_3_before_launch_naming_the_object(reference, s3_bucket, s3_endpoint, no_launch):
    _, local = reference
    client = s3_client(s3_endpoint)
    for path in (local / "step-00000002").iterdir():
        data = path.read_bytes()
        client.put_object(Bucket=s3_bucket, Key=f"bad/step-00000002/{path.name}", Body=data[:-4] if "rank-00001" in path.name else data)
    result = runner.invoke(app, ["train", "--resume", f"s3://{s3_bucket}/bad", "--nproc-per-node", "2"])
    assert result.exit_code == 3, result.output
    assert result.output.startswith(f"error: s3://{s3_bucket}/bad/step-00000002/rank-00001-of-00002.safetensors: file is ")
    assert result.output.count("\n") == 1
