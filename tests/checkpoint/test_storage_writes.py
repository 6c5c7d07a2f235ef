"""Writes to object storage interrupted, against moto's S3 server through the real CLI: a
`reshard ... s3://` SIGKILLed while the proxy holds one of its uploads leaves no commit object,
`inspect` of the prefix finds no checkpoint, and the same command run again succeeds without
--overwrite and writes, object for object, what the command writes to a local directory."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
from support.checkpoint_files import run_cli, sample_optimizer, sample_tensors, save_checkpoint
from support.fault_proxy import FaultProxy
from support.object_store import s3_client

FSDPKIT = str(Path(sys.executable).with_name("fsdpkit"))


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
    result = run_cli("inspect", url)
    assert result.exit_code != 0 and result.output.startswith("error: ") and result.output.count("\n") == 1, result.output
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


def test_a_streamed_upload_that_fails_commits_nothing_and_aborts(s3_bucket, s3_endpoint, tmp_path, monkeypatch):
    """`convert --to full` to a bucket whose every part upload fails (the multipart upload itself
    is created): exit 1 naming the object, no object left (the marker removed too), no multipart
    upload left open, nothing in TMPDIR."""
    import torch

    import fsdpkit.checkpoint.storage.objects as objects

    generator = torch.Generator().manual_seed(0)
    run = tmp_path / "run"
    save_checkpoint(run, 1, {f"h.{i}.weight": torch.randn(1024, 1024, generator=generator) for i in range(3)}, world_size=2)
    monkeypatch.setattr(objects, "RETRIES", 1)
    scratch = tmp_path / "tmpdir"
    scratch.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(scratch))
    url = f"s3://{s3_bucket}/out/failed"
    with FaultProxy(s3_endpoint, fraction=1.0, kinds=("503",), methods=("PUT",), only="out/failed/model.safetensors") as proxy:
        monkeypatch.setenv("AWS_ENDPOINT_URL", proxy.url)
        result = run_cli("convert", str(run), url, "--to", "full")
    assert result.exit_code == 1, result.output
    assert result.output.startswith(f"error: {url}/model.safetensors: write failed after retries, nothing committed"), result.output
    assert _objects(s3_endpoint, s3_bucket, "out") == {}
    assert s3_client(s3_endpoint).list_multipart_uploads(Bucket=s3_bucket).get("Uploads", []) == []
    assert list(scratch.iterdir()) == []


def test_reshard_of_dcp_and_deepspeed_and_megatron_output_to_a_bucket_are_the_local_bytes(s3_bucket, s3_endpoint, tmp_path):
    """The writers the commands stream through for these (DCP's and DeepSpeed's reshard, a tiny
    Llama from transformers `--to megatron`): every object is the file the same command writes
    to a local directory, and the report is the local one, the URL in place of the path."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

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
