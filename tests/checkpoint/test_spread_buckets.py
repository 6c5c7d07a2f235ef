"""convert spread over 2 processes from a bucket to a bucket (moto's S3 server; no shared
filesystem: every rank reads the source and writes its own files in the bucket): the objects,
read back by boto3, are byte for byte the files the one-process command writes from the same
checkpoint on a local disk, and the format's own reader reads them (safetensors, torch's
`dcp.load`); a killed rank commits nothing, and the same command continues."""

from __future__ import annotations

import contextlib
import json
import os
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from support.checkpoint_files import run_cli, save_checkpoint
from support.object_store import s3_client

SHARD = "8KB"  # several output files from the small model below


def _tensors() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(3)
    model = {f"layer.{i}.weight": torch.randn(12 + 3 * i, 32, generator=g) for i in range(6)}
    optim = {f"optim.exp_avg.{n}": torch.randn(t.shape, generator=g) for n, t in model.items()}
    return {**model, **optim, **{f"optim.exp_avg_sq.{n}": torch.rand(t.shape, generator=g) for n, t in model.items()}}


@pytest.fixture
def source(s3_bucket, s3_endpoint, tmp_path):
    """A DeepSpeed ZeRO-3 checkpoint on disk and under s3://BUCKET/src."""
    tensors = _tensors()
    save_checkpoint(tmp_path / "run", 2, tensors, world_size=2, training_state={"step": 2})
    made = run_cli("convert", tmp_path / "run", tmp_path / "src", "--to", "deepspeed", "--stage", "3", "--world-size", "2")
    assert made.exit_code == 0, made.output
    client = s3_client(s3_endpoint)
    for path in sorted((tmp_path / "src").rglob("*")):
        if path.is_file():
            client.upload_file(str(path), s3_bucket, f"src/{path.relative_to(tmp_path / 'src').as_posix()}")
    return tmp_path / "src", f"s3://{s3_bucket}/src", tensors


def _objects(endpoint: str, bucket: str, prefix: str) -> dict[str, bytes]:
    client = s3_client(endpoint)
    listed = client.list_objects_v2(Bucket=bucket, Prefix=f"{prefix}/").get("Contents", [])
    return {o["Key"][len(prefix) + 1 :]: client.get_object(Bucket=bucket, Key=o["Key"])["Body"].read() for o in listed}


def _files(directory: Path) -> dict[str, bytes]:
    return {p.relative_to(directory).as_posix(): p.read_bytes() for p in sorted(directory.rglob("*")) if p.is_file()}


def _downloaded(objects: dict[str, bytes], directory: Path) -> Path:
    for name, data in objects.items():
        (directory / name).parent.mkdir(parents=True, exist_ok=True)
        (directory / name).write_bytes(data)
    return directory


@pytest.mark.parametrize(
    "flags",
    [("--to", "full", "--with-optimizer", "--max-shard-size", "16KB"), ("--to", "dcp", "--world-size", "3")],
    ids=["full", "dcp"],
)
def test_bucket_to_bucket_over_two_processes_is_the_one_process_bytes(source, s3_bucket, s3_endpoint, tmp_path, flags):
    local, url, tensors = source
    out = f"out-{flags[1]}"  # the bucket's name is cut from the test's: both cases share it
    one = run_cli("convert", local, tmp_path / "one", *flags)
    assert one.exit_code == 0, one.output
    dry = run_cli("convert", url, f"s3://{s3_bucket}/{out}", *flags, "--nproc-per-node", "2", "--dry-run")
    assert dry.exit_code == 0 and "written whole by one rank" in dry.output, dry.output
    assert _objects(s3_endpoint, s3_bucket, out) == {}  # a dry run writes nothing
    spread = run_cli("convert", url, f"s3://{s3_bucket}/{out}", *flags, "--nproc-per-node", "2", "--json")
    assert spread.exit_code == 0, spread.output
    report = json.loads(spread.stdout)
    assert report["dst"] == f"s3://{s3_bucket}/{out}" and report["spread"]["world_size"] == 2
    assert all(rank["parts"] for rank in report["spread"]["ranks"])  # both ranks wrote files
    written = _objects(s3_endpoint, s3_bucket, out)
    assert written == _files(tmp_path / "one")  # no marker, no staging objects left
    back = _downloaded(written, tmp_path / "back")
    model = {n: t for n, t in tensors.items() if n.startswith("layer.")}
    if flags[1] == "full":
        loaded = {k: v for path in sorted(back.glob("*.safetensors")) for k, v in load_file(path).items()}
        assert "model.safetensors" in written  # one model file, the commit object (rank 0 uploads it last), and the optimizer's files
        assert model.keys() <= loaded.keys() and all(torch.equal(loaded[n], t) for n, t in model.items())
    else:
        import torch.distributed.checkpoint as dcp

        state = {"model": {n: torch.zeros_like(t) for n, t in model.items()}}
        dcp.load(state, storage_reader=dcp.FileSystemReader(str(back)), no_dist=True)
        assert all(torch.equal(state["model"][n], t) for n, t in model.items())


def test_a_killed_rank_commits_nothing_in_the_bucket_and_the_rerun_continues(source, s3_bucket, s3_endpoint, tmp_path):
    from fsdpkit.dist.faults import FAULT_ENV

    local, url, _ = source
    dst, flags = f"s3://{s3_bucket}/out", ("--to", "full", "--max-shard-size", SHARD)
    one = run_cli("convert", local, tmp_path / "one", *flags)
    assert one.exit_code == 0, one.output
    os.environ[FAULT_ENV] = "kill:1:2:convert"  # rank 1 dies as it starts its second file
    try:
        killed = run_cli("convert", url, dst, *flags, "--nproc-per-node", "2")
    finally:
        del os.environ[FAULT_ENV]
    assert killed.exit_code == 1 and "nothing committed" in killed.output, killed.output
    assert "rank 1 stopped while writing model-" in killed.output, killed.output
    left = _objects(s3_endpoint, s3_bucket, "out")
    assert ".fsdpkit-writing" in left and "model.safetensors.index.json" not in left  # no reader takes it for a checkpoint
    assert any(name.startswith(".fsdpkit-spread/done/") for name in left)
    other = run_cli("convert", url, dst, "--to", "full", "--nproc-per-node", "2")
    assert other.exit_code == 2 and "--restart" in other.output, other.output
    dry_other = run_cli("convert", url, dst, "--to", "full", "--nproc-per-node", "2", "--dry-run")
    assert dry_other.exit_code == 2 and dry_other.output.splitlines()[-1] == other.output.splitlines()[-1], dry_other.output
    planned = run_cli("convert", url, dst, *flags, "--nproc-per-node", "2", "--dry-run", "--json")
    assert planned.exit_code == 0 and _objects(s3_endpoint, s3_bucket, "out") == left  # the dry runs wrote nothing
    rerun = run_cli("convert", url, dst, *flags, "--nproc-per-node", "2", "--json")
    assert rerun.exit_code == 0, rerun.output
    assert json.loads(rerun.stdout)["spread"]["kept_parts"] == json.loads(planned.stdout)["kept_parts"] >= 2
    assert _objects(s3_endpoint, s3_bucket, "out") == _files(tmp_path / "one")
    assert s3_client(s3_endpoint).list_multipart_uploads(Bucket=s3_bucket).get("Uploads", []) == []


def test_a_second_command_on_the_same_bucket_dst_is_refused_while_the_first_writes(source, s3_bucket, s3_endpoint, tmp_path, monkeypatch):
    """The writer's lease on s3://BUCKET/out held here, as a running command holds it, with the
    object it wrote so far: every command that would write there (one process, spread over 2,
    with --overwrite or --restart, a dry run) is refused with one line and exit 2, and the
    objects stay as they are; once the first stops (a killed holder on another host: its marker
    stops changing, watched once), the same command writes there what it writes to a local
    directory, and holds the lease at every file rank 0 records."""
    import socket

    from fsdpkit.checkpoint.spread.bucket import BucketStaging
    from fsdpkit.checkpoint.storage import lease
    from fsdpkit.checkpoint.storage.lease import WRITING_MARKER, WriterLease, refuse_if_held
    from fsdpkit.checkpoint.storage.location import open_storage
    from fsdpkit.errors import UsageError

    local, url, _ = source
    dst, flags = f"s3://{s3_bucket}/out", ("--to", "full", "--max-shard-size", SHARD)
    one = run_cli("convert", local, tmp_path / "one", *flags)
    assert one.exit_code == 0, one.output
    first = WriterLease.take(open_storage(dst))
    s3_client(s3_endpoint).put_object(Bucket=s3_bucket, Key="out/model-00001-of-00002.safetensors", Body=b"written so far")
    before = _objects(s3_endpoint, s3_bucket, "out")
    line = (
        f"error: destination {dst} is being written by another fsdpkit command (pid {os.getpid()} on {socket.gethostname()} "
        f"holds {dst}/.fsdpkit-writing): wait for it to finish; nothing written"
    )
    spread = ("--nproc-per-node", "2")
    for extra in ((), ("--overwrite",), spread, (*spread, "--restart"), (*spread, "--dry-run")):
        refused = run_cli("convert", url, dst, *flags, *extra)
        assert refused.exit_code == 2 and refused.output.strip().splitlines() == [line], (extra, refused.output)
        assert _objects(s3_endpoint, s3_bucket, "out") == before
    first.release(interrupted=True)
    elsewhere = {"host": "another-node", "pid": 1, "started": "1", "lease": "theirs", "beat_seconds": 0.05, "beat": 7}
    open_storage(dst).put(WRITING_MARKER, json.dumps(elsewhere).encode())
    watched, holder_lives = [], lease._holder_lives
    monkeypatch.setattr(lease, "_holder_lives", lambda storage, found: watched.append(found["lease"]) or holder_lives(storage, found))
    held_at: list[bool] = []
    record = BucketStaging.record

    def recorded(staging, result):
        try:
            refuse_if_held(open_storage(dst))
            held_at.append(False)
        except UsageError:
            held_at.append(True)
        record(staging, result)

    monkeypatch.setattr(BucketStaging, "record", recorded)
    done = run_cli("convert", url, dst, *flags, *spread)
    assert done.exit_code == 0, done.output
    assert held_at and all(held_at), held_at
    assert watched.count("theirs") == 1, watched
    assert f"{dst}/.fsdpkit-writing names pid 1 on another-node: watching it for 0.15 s" in done.output, done.output
    assert _objects(s3_endpoint, s3_bucket, "out") == _files(tmp_path / "one")


def test_a_part_whose_spool_finds_no_room_reads_the_bucket_in_the_output_order(source, tmp_path, monkeypatch):
    """A full output's part from ZeRO-3 objects is filled in a spool in TMPDIR, its room reserved
    first; where the reservation fails (another rank of the node took the room since it was
    looked at), the part is read from the bucket in the output's order instead: the same files."""
    import errno
    import tempfile

    local, url, _ = source
    flags = ("--to", "full", "--with-optimizer", "--max-shard-size", SHARD)
    one = run_cli("convert", local, tmp_path / "one", *flags)
    assert one.exit_code == 0, one.output
    scratch = tmp_path / "tmpdir"  # on a disk, as pytest's tmp_path is: a spool goes there
    scratch.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(scratch))
    asked: list[int] = []

    def no_room(fd: int, offset: int, length: int) -> None:
        asked.append(length)
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "posix_fallocate", no_room)
    spread = run_cli("convert", url, tmp_path / "spread", *flags, "--nproc-per-node", "1")
    assert spread.exit_code == 0, spread.output
    assert len(asked) > 1, asked  # each part asked for its spool's room
    assert _files(tmp_path / "spread") == _files(tmp_path / "one")
    assert list(scratch.iterdir()) == []


def test_reshard_verify_and_diff_of_fsdpkit_checkpoints_in_a_bucket(s3_bucket, s3_endpoint, tmp_path):
    """reshard bucket -> bucket gives the one-process local bytes; verify and diff of URLs spread
    over 2 processes say what the one-process commands say of the local copies."""
    tensors = _tensors()
    save_checkpoint(tmp_path / "run", 2, tensors, world_size=2, training_state={"step": 2})
    client = s3_client(s3_endpoint)
    for path in sorted((tmp_path / "run").rglob("*")):
        if path.is_file():
            client.upload_file(str(path), s3_bucket, f"run/{path.relative_to(tmp_path / 'run').as_posix()}")
    run, out = f"s3://{s3_bucket}/run", f"s3://{s3_bucket}/r3"
    spread = run_cli("reshard", run, out, "--world-size", "3", "--nproc-per-node", "2")
    one = run_cli("reshard", tmp_path / "run", tmp_path / "r3", "--world-size", "3")
    assert spread.exit_code == one.exit_code == 0, spread.output + one.output
    assert _objects(s3_endpoint, s3_bucket, "r3") == _files(tmp_path / "r3")
    verify = run_cli("verify", out, "--nproc-per-node", "2")
    assert verify.exit_code == 0 and verify.stdout.startswith(f"ok {out}"), verify.output
    changed = {**tensors, "layer.2.weight": tensors["layer.2.weight"].flip(0)}
    save_checkpoint(tmp_path / "other", 2, changed, world_size=3, training_state={"step": 2})
    diff_one = run_cli("diff", tmp_path / "r3", tmp_path / "other", "--json")
    diff_spread = run_cli("diff", out, tmp_path / "other", "--json", "--nproc-per-node", "2")
    assert diff_one.exit_code == diff_spread.exit_code == 3, diff_spread.output
    assert json.loads(diff_spread.stdout.replace(out, str(tmp_path / "r3"))) == json.loads(diff_one.stdout)


def test_the_staging_record_in_the_bucket_is_kept_refused_or_discarded(s3_bucket, s3_endpoint):
    """prepare_bucket against the server, the objects listed by boto3: the same conversion finds
    its records again (those whose object is there and long enough), another is refused unless
    --restart (which drops them), a whole checkpoint needs --overwrite and then loses its commit
    object first, what a run leaves is what a one-process write to the URL replaces without
    --overwrite, and a commit object written there during the run is not replaced without it."""
    from fsdpkit.checkpoint.storage.upload import check_destination
    from fsdpkit.errors import UsageError

    client, url = s3_client(s3_endpoint), f"s3://{s3_bucket}/out"
    client.put_object(Bucket=s3_bucket, Key="out/manifest.json", Body=b"{}")
    client.put_object(Bucket=s3_bucket, Key="out/a.safetensors", Body=b"x" * 10)
    with pytest.raises(UsageError, match="--overwrite"):
        _prepared(url, digest="one", overwrite=False, restart=False)
    staging = _prepared(url, digest="one", overwrite=True, restart=False)
    assert "manifest.json" not in _objects(s3_endpoint, s3_bucket, "out")  # no reader takes old and new for one checkpoint
    staging.write_state("done/00000-00000.json", json.dumps({"file": 0, "index": 0, "name": "a.safetensors", "begin": 0, "end": 10}))
    staging.write_state("done/00000-00001.json", json.dumps({"file": 0, "index": 1, "name": "a.safetensors", "begin": 0, "end": 11}))
    staging.write_state("done/00001-00000.json", json.dumps({"file": 1, "index": 0, "name": "b.safetensors", "begin": 0, "end": 5}))
    check_destination(staging.storage, overwrite=False)  # an interrupted write: replaced without --overwrite
    found = _prepared(url, digest="one", overwrite=False, restart=False).records()
    assert list(found) == [(0, 0)]  # not the record longer than its object, nor the one without an object
    with pytest.raises(UsageError, match="--restart"):
        _prepared(url, digest="two", overwrite=False, restart=False)
    restarted = _prepared(url, digest="two", overwrite=False, restart=True)
    assert restarted.records() == {}
    names = set(_objects(s3_endpoint, s3_bucket, "out"))
    assert names == {"a.safetensors", ".fsdpkit-writing", ".fsdpkit-spread/plan.json", ".fsdpkit-spread/token"}
    client.put_object(Bucket=s3_bucket, Key="out/manifest.json", Body=b"theirs")  # a checkpoint written there meanwhile
    with pytest.raises(UsageError, match="manifest.json appeared while the conversion ran; pass --overwrite"):
        restarted.commit_job(None, [], url, overwrite=False)
    left = _objects(s3_endpoint, s3_bucket, "out")
    assert set(left) == {*names, "manifest.json"} and left["manifest.json"] == b"theirs"


def _prepared(url: str, **options):
    """Rank 0's staging objects at `url`, its lease given up as a run that stopped gives it up."""
    from fsdpkit.checkpoint.spread.bucket import prepare_bucket

    with contextlib.ExitStack() as held:
        return prepare_bucket(url, held=held, **options)


def _without_spread(stdout: str) -> dict:
    report = json.loads(stdout)
    report.pop("spread", None)
    return report


def test_verify_of_deepspeed_and_dcp_checkpoints_in_a_bucket_spreads(source, s3_bucket, s3_endpoint, tmp_path):
    """verify of a DeepSpeed ZeRO-3 and a torch DCP checkpoint (written by `dcp.save`) in a bucket,
    spread over 2 processes that each read their own files' ranges there, says what the one-process
    verify of the same URL says; a truncated object is the same one error line, exit 3."""
    import torch.distributed.checkpoint as dcp

    local, url, tensors = source
    dcp.save({k: v for k, v in tensors.items() if k.startswith("layer")}, checkpoint_id=str(tmp_path / "dcp"), no_dist=True)
    client = s3_client(s3_endpoint)
    for path in sorted((tmp_path / "dcp").iterdir()):
        client.upload_file(str(path), s3_bucket, f"dcp/{path.name}")
    for where in (url, f"s3://{s3_bucket}/dcp"):
        one = run_cli("verify", where, "--json")
        spread = run_cli("verify", where, "--json", "--nproc-per-node", "2")
        assert one.exit_code == spread.exit_code == 0, one.output + spread.output
        assert _without_spread(spread.stdout) == _without_spread(one.stdout)
        assert json.loads(spread.stdout)["spread"]["world_size"] == 2
    report = json.loads(run_cli("verify", local, "--json").stdout)
    assert "20 storages against the zip's CRC-32" in report["checked"] and report["not_checked"] == []  # CRC-32s written
    data = f"dcp/{next(p.name for p in (tmp_path / 'dcp').iterdir() if p.suffix == '.distcp')}"
    body = client.get_object(Bucket=s3_bucket, Key=data)["Body"].read()
    client.put_object(Bucket=s3_bucket, Key=data, Body=body[: len(body) // 2])  # truncated
    where = f"s3://{s3_bucket}/dcp"
    one, spread = run_cli("verify", where), run_cli("verify", where, "--nproc-per-node", "2")
    errors = [[line for line in r.output.splitlines() if line.startswith("error:")] for r in (one, spread)]
    assert one.exit_code == spread.exit_code == 3 and len(errors[0]) == 1 and errors[0] == errors[1], (one.output, spread.output)
    assert data in errors[0][0]
