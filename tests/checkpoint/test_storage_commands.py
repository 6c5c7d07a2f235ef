"""The offline commands on object storage, against moto's S3 server: `verify`, `inspect`,
`convert`, `reshard` and `diff` of a checkpoint in a bucket give what they give of the same
checkpoint on a local disk (the local reader is the oracle; boto3 uploads and reads back the
objects), through a proxy that fails requests too; torch's own DCP code reads what fsdpkit
writes there and writes what fsdpkit reads; train's URLs are checked before launch in one line."""

from __future__ import annotations

import json
import tempfile
from pathlib import Path

import pytest
from support.checkpoint_files import run_cli, sample_optimizer, sample_tensors, save_checkpoint
from support.fault_proxy import FaultProxy
from support.object_store import s3_client


def _upload(client, bucket: str, root: Path, prefix: str) -> None:
    for path in sorted(root.rglob("*")):
        if path.is_file():
            client.upload_file(str(path), bucket, f"{prefix}/{path.relative_to(root).as_posix()}")


@pytest.fixture
def run_in_bucket(s3_bucket, s3_endpoint, tmp_path):
    """A run of two steps, world size 2, on disk and under s3://BUCKET/runs/a."""
    params = sample_tensors()
    tensors = {**params, **sample_optimizer(params)}
    run = tmp_path / "run"
    save_checkpoint(run, 1, tensors, world_size=2)
    save_checkpoint(run, 2, tensors, world_size=2)
    _upload(s3_client(s3_endpoint), s3_bucket, run, "runs/a")
    return run, f"s3://{s3_bucket}/runs/a"


def _json(*args: str) -> tuple[int, dict]:
    result = run_cli(*args, "--json")
    return result.exit_code, json.loads(result.stdout)


def _same(local: dict, remote: dict, run: Path, url: str) -> None:
    assert json.loads(json.dumps(remote).replace(url, str(run))) == local


def test_verify_and_inspect_in_a_bucket_match_the_local_checkpoint(run_in_bucket):
    run, url = run_in_bucket
    for command in ("verify", "inspect"):
        local_code, local = _json(command, str(run))
        code, remote = _json(command, url)
        assert code == local_code == 0
        _same(local, remote, run, url)
    assert remote["path"] == f"{url}/step-00000002"  # `latest` named the step
    result = run_cli("verify", f"{url}/step-00000001")
    assert result.exit_code == 0 and result.stdout.startswith(f"ok {url}/step-00000001: sharded, ")


def test_a_corrupt_byte_in_a_bucket_is_found_as_locally(run_in_bucket, s3_bucket, s3_endpoint):
    run, url = run_in_bucket
    rank_file = run / "step-00000002" / "rank-00001-of-00002.safetensors"
    data = bytearray(rank_file.read_bytes())
    data[-3] ^= 0x40
    rank_file.write_bytes(bytes(data))
    s3_client(s3_endpoint).put_object(Bucket=s3_bucket, Key="runs/a/step-00000002/rank-00001-of-00002.safetensors", Body=bytes(data))
    local_code, local = _json("verify", str(run))
    code, remote = _json("verify", url)
    assert code == local_code == 3 and len(local["problems"]) == 1 and "checksum mismatch" in local["problems"][0]
    _same(local, remote, run, url)


def test_verify_through_failing_requests_gives_the_clean_answer(run_in_bucket, s3_endpoint, monkeypatch):
    run, url = run_in_bucket
    clean = _json("verify", url)
    with FaultProxy(s3_endpoint, fraction=0.2, seed=5) as proxy:
        monkeypatch.setenv("AWS_ENDPOINT_URL", proxy.url)
        assert _json("verify", url) == clean
        code, remote = _json("inspect", url)
    assert code == 0
    _same(_json("inspect", str(run))[1], remote, run, url)
    assert sum(proxy.faults.values()) > 0


def test_verify_progress_in_a_bucket_ends_at_the_bytes_of_the_step_it_checks(run_in_bucket):
    """A run of two steps: the progress of `verify` counts the rank files of the step `latest`
    names, each byte once, up to a total of exactly their size on disk."""
    from fsdpkit.checkpoint.offline.locations import verify_at

    run, url = run_in_bucket
    calls: list[tuple[int, int]] = []
    assert verify_at(url, lambda done, total: calls.append((done, total))).ok
    on_disk = sum(path.stat().st_size for path in (run / "step-00000002").glob("rank-*"))
    assert {total for _, total in calls} == {on_disk}
    assert sum(done for done, _ in calls) == on_disk


def test_convert_reshard_and_diff_read_a_bucket_as_a_directory(run_in_bucket, s3_bucket, s3_endpoint, tmp_path):
    """A source in a bucket gives the same output as the same source on disk, byte for byte;
    a full checkpoint in a bucket (a format read from a local copy) inspects as on disk."""
    run, url = run_in_bucket
    for command, extra in (("convert", ("--to", "full", "--with-optimizer")), ("reshard", ("--world-size", "3"))):
        from_bucket, from_disk = tmp_path / f"{command}-bucket", tmp_path / f"{command}-disk"
        result = run_cli(command, url, str(from_bucket), *extra, "--json")
        assert result.exit_code == 0, result.output
        assert json.loads(result.stdout)["src"] == f"{url}/step-00000002"
        assert run_cli(command, str(run), str(from_disk), *extra).exit_code == 0
        files = sorted(p.relative_to(from_disk) for p in from_disk.rglob("*") if p.is_file())
        assert files == sorted(p.relative_to(from_bucket) for p in from_bucket.rglob("*") if p.is_file())
        assert all((from_disk / f).read_bytes() == (from_bucket / f).read_bytes() for f in files)
    code, found = _json("diff", url, str(run / "step-00000002"))
    assert code == 0 and found["equal"] and found["a"]["path"].startswith(url)
    _upload(s3_client(s3_endpoint), s3_bucket, tmp_path / "convert-disk", "full")
    local_code, local = _json("inspect", str(tmp_path / "convert-disk"))
    code, remote = _json("inspect", f"s3://{s3_bucket}/full")
    assert code == local_code == 0 and remote["format"] == "full"
    _same(local, remote, tmp_path / "convert-disk", f"s3://{s3_bucket}/full")


def test_train_checks_its_urls_before_launch_in_one_line(run_in_bucket, s3_bucket, no_launch):
    _, url = run_in_bucket
    cases = {
        ("--save-dir", "s3://no-such-bucket-here/run"): "the bucket does not exist",
        ("--resume", f"s3://{s3_bucket}/no/such/run"): "no objects under this prefix",
        ("--init-from", f"s3://{s3_bucket}/no/such/run"): "no objects under this prefix",
        ("--new-run", "--save-dir", f"s3://{s3_bucket}/runs/new"): "an object store cannot set the earlier checkpoints aside",
        ("--save-dir", url): "already holds checkpoints step-00000001, step-00000002 of another run",
    }
    for flags, said in cases.items():
        result = run_cli("train", "--steps", "1", *flags)
        assert result.exit_code == 2 and result.output.startswith("error: ") and said in result.output, (flags, result.output)
        assert result.output.count("\n") == 1


def test_open_checkpoint_of_a_url_reads_the_tensors_and_cleans_up(run_in_bucket, monkeypatch, tmp_path):
    import torch

    from fsdpkit.checkpoint.offline.formats import open_checkpoint

    _, url = run_in_bucket
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path / "staging"))
    (tmp_path / "staging").mkdir()
    expected = sample_tensors()
    with open_checkpoint(url) as opened:
        assert opened.opened_from == url and sorted(opened.model) == sorted(expected)
        for name, tensor in expected.items():
            assert torch.equal(opened.get_tensor(name), tensor), name
    assert list((tmp_path / "staging").iterdir()) == []


def test_a_missing_prefix_or_bucket_is_one_line(s3_bucket):
    for command in ("verify", "inspect"):
        result = run_cli(command, f"s3://{s3_bucket}/no/such/run")
        assert result.exit_code == 2 and result.output == f"error: s3://{s3_bucket}/no/such/run: no objects under this prefix\n"
    result = run_cli("verify", "s3://no-such-bucket-here/run")
    assert result.exit_code == 2 and "the bucket does not exist" in result.output


def _fsspec_reader(url: str):
    from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader

    return FsspecReader(url)


def _s3torchconnector_reader(url: str):
    """AWS's S3StorageReader; its client takes the endpoint from AWS_ENDPOINT_URL and needs
    path-style addressing for a server on 127.0.0.1."""
    from s3torchconnector import S3ClientConfig
    from s3torchconnector.dcp import S3StorageReader

    return S3StorageReader("us-east-1", url, s3client_config=S3ClientConfig(force_path_style=True))


@pytest.mark.parametrize("reader", [_fsspec_reader, _s3torchconnector_reader], ids=["fsspec", "s3torchconnector"])
def test_a_dcp_checkpoint_fsdpkit_writes_to_a_bucket_loads_with_torchs_readers(run_in_bucket, s3_bucket, reader):
    """torch's own FsspecReader (through s3fs) and AWS's S3StorageReader (s3torchconnector) are
    the oracles: each loads what `convert --to dcp s3://` wrote, equal to the tensors saved locally."""
    import torch
    import torch.distributed.checkpoint as dcp

    run, _ = run_in_bucket
    url = f"s3://{s3_bucket}/out/{reader.__name__.strip('_')}"  # the bucket's name is cut short, so one for both readers
    storage_reader = reader(url)
    result = run_cli("convert", str(run), url, "--to", "dcp", "--world-size", "2")
    assert result.exit_code == 0, result.output
    assert result.stdout.startswith(f"wrote {url}: ")
    expected = sample_tensors()
    loaded = {"model": {name: torch.zeros_like(tensor) for name, tensor in expected.items()}}
    dcp.load(loaded, storage_reader=storage_reader, no_dist=True)
    for name, tensor in expected.items():
        assert torch.equal(loaded["model"][name], tensor), name


def test_convert_and_reshard_to_a_bucket_write_what_they_write_locally(run_in_bucket, s3_bucket, s3_endpoint, tmp_path):
    """Every object (read back by boto3) is byte for byte the file the same command writes locally."""
    run, _ = run_in_bucket
    client = s3_client(s3_endpoint)
    for command, extra in (("convert", ("--to", "full", "--with-optimizer")), ("reshard", ("--world-size", "3"))):
        url, local = f"s3://{s3_bucket}/out/{command}", tmp_path / command
        assert run_cli(command, str(run), url, *extra).exit_code == 0
        assert run_cli(command, str(run), str(local), *extra).exit_code == 0
        objects = client.list_objects_v2(Bucket=s3_bucket, Prefix=f"out/{command}/")["Contents"]
        written = {o["Key"][len(f"out/{command}/") :]: client.get_object(Bucket=s3_bucket, Key=o["Key"])["Body"].read() for o in objects}
        assert written == {p.relative_to(local).as_posix(): p.read_bytes() for p in local.rglob("*") if p.is_file()}
        result = run_cli(command, str(run), url, *extra)
        assert result.exit_code == 2 and "already holds" in result.output and "pass --overwrite" in result.output
        assert run_cli(command, str(run), url, *extra, "--overwrite").exit_code == 0
    code, remote = _json("verify", f"s3://{s3_bucket}/out/reshard")
    assert code == 0 and remote["ok"] and remote["counts" if "counts" in remote else "fragments"]


def test_a_failed_upload_commits_nothing_and_leaves_no_upload_open(run_in_bucket, s3_bucket, s3_endpoint, monkeypatch, tmp_path):
    import fsdpkit.checkpoint.storage.objects as objects

    run, _ = run_in_bucket
    monkeypatch.setattr(objects, "RETRIES", 1)
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path / "staging"))
    (tmp_path / "staging").mkdir()
    url = f"s3://{s3_bucket}/out/failed"
    with FaultProxy(s3_endpoint, fraction=1.0, kinds=("503",), methods=("PUT",)) as proxy:  # every part and PUT fails
        monkeypatch.setenv("AWS_ENDPOINT_URL", proxy.url)
        result = run_cli("reshard", str(run), url, "--world-size", "2")
    assert result.exit_code == 1, result.output
    assert result.output.startswith(f"error: {url}/") and "failed after retries, nothing committed" in result.output
    client = s3_client(s3_endpoint)
    assert [o["Key"] for o in client.list_objects_v2(Bucket=s3_bucket, Prefix="out/").get("Contents", [])] == []
    assert client.list_multipart_uploads(Bucket=s3_bucket).get("Uploads", []) == []
    assert list((tmp_path / "staging").iterdir()) == []  # the staged output is gone too


def test_a_dcp_checkpoint_torchs_fsspec_writer_put_in_a_bucket_is_read_there(s3_bucket, s3_endpoint, tmp_path):
    """torch writes the same state dict twice, to the bucket (FsspecWriter through s3fs) and to a
    directory (FileSystemWriter); fsdpkit's verify and inspect of the bucket's give what they give
    of the directory's, and the summary counts the state dict's tensors."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import FileSystemWriter
    from torch.distributed.checkpoint._fsspec_filesystem import FsspecWriter

    params = sample_tensors()
    state = {"model": params, "optimizer": {"state": {name: {"exp_avg": t * 0.5} for name, t in params.items()}}}
    url, local = f"s3://{s3_bucket}/dcp/torch", tmp_path / "dcp"
    dcp.save(state, storage_writer=FsspecWriter(url), no_dist=True)
    dcp.save(state, storage_writer=FileSystemWriter(str(local)), no_dist=True)
    for command in ("verify", "inspect"):
        local_code, expected = _json(command, str(local))
        code, found = _json(command, url)
        assert code == local_code == 0
        _same(expected, found, local, url)
    assert found["model"]["tensors"] == len(params) and found["model"]["bytes"] == sum(t.nbytes for t in params.values())
    assert found["optimizer"]["tensors"] == len(params)
    client = s3_client(s3_endpoint)
    data = next(o["Key"] for o in client.list_objects_v2(Bucket=s3_bucket, Prefix="dcp/torch/")["Contents"] if o["Key"].endswith(".distcp"))
    body = client.get_object(Bucket=s3_bucket, Key=data)["Body"].read()
    client.put_object(Bucket=s3_bucket, Key=data, Body=body[: len(body) // 2])  # truncated
    result = run_cli("verify", url)
    assert result.exit_code == 3 and f"s3://{s3_bucket}/{data}" in result.output and "truncated" in result.output


def test_reshard_bucket_to_bucket_through_failing_requests_writes_the_clean_output(
    run_in_bucket, s3_bucket, s3_endpoint, monkeypatch, tmp_path
):
    """10% of the requests answered 503 or 500 or dropped: the output is byte for byte the local one."""
    run, url = run_in_bucket
    assert run_cli("reshard", str(run), str(tmp_path / "local"), "--world-size", "3").exit_code == 0
    with FaultProxy(s3_endpoint, fraction=0.1, seed=11) as proxy:
        monkeypatch.setenv("AWS_ENDPOINT_URL", proxy.url)
        result = run_cli("reshard", url, f"s3://{s3_bucket}/out/faulty", "--world-size", "3")
    assert result.exit_code == 0, result.output
    assert sum(proxy.faults.values()) > 0
    client = s3_client(s3_endpoint)
    objects = client.list_objects_v2(Bucket=s3_bucket, Prefix="out/faulty/")["Contents"]
    written = {o["Key"][len("out/faulty/") :]: client.get_object(Bucket=s3_bucket, Key=o["Key"])["Body"].read() for o in objects}
    assert written == {p.name: p.read_bytes() for p in (tmp_path / "local").iterdir()}
