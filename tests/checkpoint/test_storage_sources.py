"""Every format read in place from a bucket (moto's S3 server): each source is written by its own
tool (DeepSpeed's `save_checkpoint` at ZeRO-3, verl's per-rank `torch.save` files of FSDP2,
torch's `dcp.save` through its `FsspecWriter` straight into the bucket, safetensors' `save_file`,
Megatron-Core's own fixtures), the local copy holds the same bytes, and `convert`, `reshard`,
`diff`, `inspect` and `verify` of the URL give what they give of the local copy, byte for byte.
The oracle is the local reading of the same files. A URL source is never copied to disk: the
GETs the server answers add up to the source's bytes and a little metadata, and TMPDIR stays
empty while the command runs."""

from __future__ import annotations

import json
import os
import shutil
import tempfile
import threading
from pathlib import Path

import pytest
import torch
from support.checkpoint_files import run_cli, sample_tensors
from support.distributed import run_distributed
from support.fault_proxy import FaultProxy
from support.object_store import s3_client

MEGATRON = Path(__file__).resolve().parents[1] / "fixtures" / "megatron"
FORMATS = ("deepspeed", "torch-save-ranks", "full", "dcp", "megatron", "megatron-zarr")
CONVERTS = {  # format -> the conversions run from it
    "deepspeed": [("--to", "full", "--with-optimizer"), ("--to", "sharded", "--world-size", "3")],
    "torch-save-ranks": [
        (
            "--to",
            "full",
        ),
        ("--to", "dcp", "--world-size", "2"),
    ],
    "full": [("--to", "sharded", "--world-size", "2"), ("--to", "dcp", "--world-size", "3")],
    "dcp": [("--to", "full", "--with-optimizer"), ("--to", "deepspeed", "--stage", "3", "--world-size", "2")],
    "megatron": [
        (
            "--to",
            "full",
        ),
        ("--to", "sharded", "--world-size", "2"),
    ],
    "megatron-zarr": [
        (
            "--to",
            "full",
        )
    ],
}
RESHARDABLE = ("deepspeed", "dcp")


def _launched(root: str) -> None:
    """2 gloo ranks: DeepSpeed's ZeRO-3 run saved by DeepSpeed, and verl's files of an FSDP2 run."""
    from support import deepspeed_worker
    from support.fsdp2_loader import sharded_llama, write_verl
    from support.verl_fsdp1 import train_step

    deepspeed_worker.init_deepspeed()
    deepspeed_worker.train_and_save(root, "deepspeed", 3, "fp32")
    model, optimizer = sharded_llama(False)
    train_step(model, optimizer)
    write_verl(f"{root}/torch-save-ranks", model, optimizer)


@pytest.fixture(scope="module")
def written(tmp_path_factory) -> Path:
    """The sources other tools write to a local directory (DCP is written into each test's bucket)."""
    from safetensors.torch import save_file

    root = tmp_path_factory.mktemp("sources")
    run_distributed(_launched, 2, str(root))
    (root / "full").mkdir()
    save_file(sample_tensors(), str(root / "full" / "model.safetensors"), metadata={"format": "pt"})
    shutil.copytree(MEGATRON / "mcore_0_16_torch_dist" / "checkpoint", root / "megatron")
    shutil.copytree(MEGATRON / "mcore_0_15_zarr" / "checkpoint", root / "megatron-zarr")
    return root


def _source(name: str, written: Path, bucket: str, endpoint: str, tmp_path: Path) -> tuple[Path, str]:
    """(the local copy, the URL) of source `name`, the same bytes in both."""
    client, url = s3_client(endpoint), f"s3://{bucket}/src/{name}"
    if name == "dcp":
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint._fsspec_filesystem import FsspecWriter

        params = sample_tensors()
        state = {"model": params, "optimizer": {"state": {n: {"exp_avg": t * 0.5, "exp_avg_sq": t * t} for n, t in params.items()}}}
        dcp.save(state, storage_writer=FsspecWriter(url), no_dist=True)
        local = tmp_path / "dcp"
        for item in client.list_objects_v2(Bucket=bucket, Prefix="src/dcp/")["Contents"]:
            (local / item["Key"].removeprefix("src/dcp/")).parent.mkdir(parents=True, exist_ok=True)
            client.download_file(bucket, item["Key"], str(local / item["Key"].removeprefix("src/dcp/")))
        return local, url
    local = written / name
    for path in sorted(local.rglob("*")):
        if path.is_file():
            client.upload_file(str(path), bucket, f"src/{name}/{path.relative_to(local).as_posix()}")
    return local, url


def _files(root: Path) -> dict[str, bytes]:
    return {p.relative_to(root).as_posix(): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def _json(*args: object) -> tuple[int, dict]:
    result = run_cli(*args, "--json")
    assert result.stdout, result.output
    return result.exit_code, json.loads(result.stdout)


@pytest.mark.parametrize("name", FORMATS)
def test_a_bucket_source_gives_what_its_local_copy_gives(name, written, s3_bucket, s3_endpoint, tmp_path):
    local, url = _source(name, written, s3_bucket, s3_endpoint, tmp_path)
    for index, options in enumerate(CONVERTS[name]):
        from_disk, from_bucket = tmp_path / f"disk-{index}", tmp_path / f"bucket-{index}"
        done = run_cli("convert", local, from_disk, *options)
        assert done.exit_code == 0, done.output
        done = run_cli("convert", url, from_bucket, *options)
        assert done.exit_code == 0, done.output
        assert _files(from_bucket) == _files(from_disk), options
    if name in RESHARDABLE:
        assert run_cli("reshard", local, tmp_path / "reshard-disk", "--world-size", "3").exit_code == 0
        done = run_cli("reshard", url, tmp_path / "reshard-bucket", "--world-size", "3")
        assert done.exit_code == 0, done.output
        assert _files(tmp_path / "reshard-bucket") == _files(tmp_path / "reshard-disk")
    for command in ("inspect", "verify"):
        local_code, expected = _json(command, local)
        code, found = _json(command, url)
        assert code == local_code == 0
        assert json.loads(json.dumps(found).replace(url, str(local))) == expected
    code, diff = _json("diff", url, local)
    assert code == 0 and diff["equal"] and {r["status"] for r in diff["tensors"]} == {"equal"}, diff


def _watch_size(directory: Path, stop: threading.Event, peak: list[int]) -> None:
    while not stop.wait(0.01):
        size = sum(p.stat().st_size for p in directory.rglob("*") if p.is_file())
        peak[0] = max(peak[0], size)


def test_a_bucket_source_is_fetched_once_and_never_copied_to_disk(s3_bucket, s3_endpoint, tmp_path, monkeypatch):
    """A full checkpoint of 16 MiB (safetensors' own file) laid out for 2 ranks from its bucket:
    each rank file takes half of every tensor, so the source is read in two passes that skip
    about; the GETs the server answers still hold each byte of it once, plus its header read
    a few times (a 256 KiB block per reader), and nothing lands in TMPDIR while the command runs."""
    from safetensors.torch import save_file

    tensors = {f"layer{i}.weight": torch.randn(1024, 1024, generator=torch.Generator().manual_seed(i)) for i in range(4)}
    local = tmp_path / "full"
    local.mkdir()
    save_file(tensors, str(local / "model.safetensors"), metadata={"format": "pt"})
    source_bytes = (local / "model.safetensors").stat().st_size
    s3_client(s3_endpoint).upload_file(str(local / "model.safetensors"), s3_bucket, "src/full/model.safetensors")
    scratch = tmp_path / "tmpdir"
    scratch.mkdir()
    monkeypatch.setenv("TMPDIR", str(scratch))
    monkeypatch.setattr(tempfile, "tempdir", None)
    stop, peak = threading.Event(), [0]
    watcher = threading.Thread(target=_watch_size, args=(scratch, stop, peak))
    with FaultProxy(s3_endpoint, fraction=0.0) as proxy:
        monkeypatch.setenv("AWS_ENDPOINT_URL", proxy.url)
        watcher.start()
        try:
            done = run_cli("convert", f"s3://{s3_bucket}/src/full", tmp_path / "out", "--to", "sharded", "--world-size", "2")
        finally:
            stop.set()
            watcher.join()
    assert done.exit_code == 0, done.output
    assert peak[0] == 0 and not os.listdir(scratch)
    assert source_bytes <= proxy.got_bytes <= source_bytes + (1 << 20), (proxy.got_bytes, source_bytes)
    assert run_cli("convert", local, tmp_path / "local", "--to", "sharded", "--world-size", "2").exit_code == 0
    assert _files(tmp_path / "out") == _files(tmp_path / "local")


def test_a_version_1_checkpoint_in_a_bucket_verifies_and_inspects_as_on_disk(s3_bucket, s3_endpoint, tmp_path):
    from support.checkpoint_files import sample_optimizer
    from support.checkpoint_v1 import write_v1

    params = sample_tensors()
    step_dir = write_v1(
        tmp_path / "v1" / "step-00000004", {**params, **sample_optimizer(params)}, world_size=2, units=None, training_state={"step": 4}
    )
    client, url = s3_client(s3_endpoint), f"s3://{s3_bucket}/v1/step-00000004"
    for path in sorted(step_dir.iterdir()):
        client.upload_file(str(path), s3_bucket, f"v1/step-00000004/{path.name}")
    for command in ("verify", "inspect"):
        local_code, expected = _json(command, step_dir)
        code, found = _json(command, url)
        assert code == local_code == 0 and expected.get("version", 1) == 1
        assert json.loads(json.dumps(found).replace(url, str(step_dir))) == expected


def test_a_deepspeed_zero3_source_is_fetched_at_most_once(written, s3_bucket, s3_endpoint, tmp_path, monkeypatch):
    """ZeRO-3 -> full with Adam's moments reads each rank file's partitions in the output's order,
    not the file's: the headers, zip directories and pickles are fetched once (shared blocks) and
    every tensor's bytes once, so the GETs hold no more than the source (its scripts unread)."""
    local, url = _source("deepspeed", written, s3_bucket, s3_endpoint, tmp_path)
    source_bytes = sum(p.stat().st_size for p in local.rglob("*") if p.is_file())
    with FaultProxy(s3_endpoint, fraction=0.0) as proxy:
        monkeypatch.setenv("AWS_ENDPOINT_URL", proxy.url)
        done = run_cli("convert", url, tmp_path / "out", "--to", "full", "--with-optimizer")
    assert done.exit_code == 0, done.output
    assert proxy.got_bytes <= source_bytes, (proxy.got_bytes, source_bytes)


def test_large_unchecked_pieces_of_a_bucket_source_stream_through_the_face(s3_bucket, s3_endpoint, tmp_path):
    """A DCP checkpoint (torch's `dcp.save`) of 1 MiB tensors, which have no checksum: on disk
    the kernel copies them file to file; from a bucket their bytes come through the face, and
    `--to full` writes the same files either way."""
    import torch.distributed.checkpoint as dcp

    tensors = {f"layer{i}.weight": torch.randn(512, 512, generator=torch.Generator().manual_seed(i)) for i in range(3)}
    local = tmp_path / "dcp"
    dcp.save(tensors, checkpoint_id=str(local), no_dist=True)
    client = s3_client(s3_endpoint)
    for path in sorted(local.iterdir()):
        client.upload_file(str(path), s3_bucket, f"src/big-dcp/{path.name}")
    done = run_cli("convert", f"s3://{s3_bucket}/src/big-dcp", tmp_path / "bucket", "--to", "full")
    assert done.exit_code == 0, done.output
    assert run_cli("convert", local, tmp_path / "disk", "--to", "full").exit_code == 0
    assert _files(tmp_path / "bucket") == _files(tmp_path / "disk")
    from safetensors.torch import load_file

    loaded = load_file(str(tmp_path / "bucket" / "model.safetensors"))
    assert all(torch.equal(loaded[name], tensor) for name, tensor in tensors.items()), sorted(loaded)


def test_deepspeed_output_from_a_bucket_source_carries_the_crc32_of_bytes_read_through_the_face(s3_bucket, s3_endpoint, tmp_path):
    """Safetensors (no checksums) of a 76.8 KB weight and its Adam moments in a bucket: `--to
    deepspeed` sums the bytes that came through the face as a local source's mapped ones, the
    same files, each passing Python's zipfile check of every CRC-32."""
    import zipfile

    from safetensors.torch import save_file

    g = torch.Generator().manual_seed(7)
    tensors = {name: torch.randn(300, 64, generator=g) for name in ("w", "optim.exp_avg.w", "optim.exp_avg_sq.w")}
    (tmp_path / "full").mkdir()
    save_file(tensors, tmp_path / "full" / "model.safetensors")
    s3_client(s3_endpoint).upload_file(str(tmp_path / "full" / "model.safetensors"), s3_bucket, "src/st/model.safetensors")
    flags = ("--to", "deepspeed", "--stage", "2", "--world-size", "1")
    assert run_cli("convert", f"s3://{s3_bucket}/src/st", tmp_path / "bucket", *flags).exit_code == 0
    assert run_cli("convert", tmp_path / "full", tmp_path / "disk", *flags).exit_code == 0
    assert _files(tmp_path / "bucket") == _files(tmp_path / "disk")
    for path in sorted((tmp_path / "bucket").rglob("*.pt")):
        with zipfile.ZipFile(path) as archive:
            assert archive.testzip() is None, path


def test_a_transformers_model_in_a_bucket_converts_to_megatron_by_its_config_json(s3_bucket, s3_endpoint, tmp_path):
    """GPT-2 as transformers saves it (config.json beside model.safetensors) in a bucket: `--to
    megatron` reads the model's shape from the bucket's config.json, as from the local copy's,
    and writes the same bytes."""
    import transformers

    config = transformers.GPT2Config(vocab_size=96, n_positions=16, n_embd=32, n_layer=2, n_head=4, n_inner=64)
    torch.manual_seed(0)
    transformers.GPT2LMHeadModel(config).save_pretrained(str(tmp_path / "gpt2"))
    client = s3_client(s3_endpoint)
    for path in sorted((tmp_path / "gpt2").iterdir()):
        client.upload_file(str(path), s3_bucket, f"gpt2/{path.name}")
    done = run_cli("convert", tmp_path / "gpt2", tmp_path / "from-disk", "--to", "megatron")
    assert done.exit_code == 0, done.output
    done = run_cli("convert", f"s3://{s3_bucket}/gpt2", tmp_path / "from-bucket", "--to", "megatron", "--json")
    assert done.exit_code == 0, done.output
    assert json.loads(done.stdout)["shape"]["layers"] == 2
    assert _files(tmp_path / "from-bucket") == _files(tmp_path / "from-disk")


@pytest.mark.parametrize(("dst", "cast"), [("disk", ()), ("bucket", ()), ("bucket", ("--dtype", "bf16"))])
def test_a_zero3_source_in_a_bucket_is_read_in_file_order(dst, cast, s3_bucket, s3_endpoint, tmp_path, monkeypatch):
    """12 layers in a ZeRO-3 checkpoint at 2 ranks (each rank file: its flat fp32 partition in
    module order, h.0, h.1, h.2, ...) converted --to full, whose order is safetensors' (h.0, h.1,
    h.10, h.11, h.2, ...): to a bucket, each rank file's partition is fetched by one GET (the
    output filled out of order), to disk in a few GETs (batches of the output read in file order),
    never one per tensor; each byte once, and the output is the local convert's and holds the
    weights, cast where asked."""
    from safetensors.torch import load_file
    from support.checkpoint_files import sample_optimizer, save_checkpoint

    from fsdpkit.checkpoint.core import bytecopy
    from fsdpkit.checkpoint.spread import scattered

    g = torch.Generator().manual_seed(0)
    weights = {
        f"h.{i}.{kind}": torch.randn(shape, generator=g) for i in range(12) for kind, shape in (("weight", (512, 512)), ("bias", (512,)))
    }
    units = [[f"h.{i}.weight", f"h.{i}.bias"] for i in range(12)]
    save_checkpoint(tmp_path / "sharded", 1, {**weights, **sample_optimizer(weights)}, world_size=2, units=units)
    local = tmp_path / "ds"
    assert run_cli("convert", tmp_path / "sharded", local, "--to", "deepspeed", "--stage", "3", "--world-size", "2").exit_code == 0
    _, url = _source("ds", tmp_path, s3_bucket, s3_endpoint, tmp_path)
    source_bytes = sum(p.stat().st_size for p in local.rglob("*") if p.is_file())
    monkeypatch.setattr(bytecopy, "READ_AHEAD_BYTES", 5 << 20)  # 3 batches of the 12 MiB of weights
    monkeypatch.setattr(scattered, "TILE_BYTES", 1 << 20)  # tiles sent while others wait for their bytes
    prefix = "-".join(["out", *cast[1:]])  # the bucket is this test's, whatever the parameters
    out = f"s3://{s3_bucket}/{prefix}" if dst == "bucket" else tmp_path / "out"
    with FaultProxy(s3_endpoint, fraction=0.0) as proxy:
        monkeypatch.setenv("AWS_ENDPOINT_URL", proxy.url)
        done = run_cli("convert", url, out, "--to", "full", *cast)
    assert done.exit_code == 0, done.output
    rank_files = {path.rpartition("/")[2]: count for path, count in proxy.gets.items() if path.endswith("optim_states.pt")}
    # 4 GETs of a rank file's zip headers (its end, its pickle, its records' local headers), then
    # its partition: 1 filling the bucket's output; 6 in the disk's batches; 27 in the output's order
    assert len(rank_files) == 2 and max(rank_files.values()) <= (5 if dst == "bucket" else 12), rank_files
    assert proxy.got_bytes <= source_bytes, (proxy.got_bytes, source_bytes)
    assert run_cli("convert", local, tmp_path / "local", "--to", "full", *cast).exit_code == 0
    if dst == "bucket":
        s3_client(s3_endpoint).download_file(s3_bucket, f"{prefix}/model.safetensors", str(tmp_path / "model.safetensors"))
        assert (tmp_path / "model.safetensors").read_bytes() == (tmp_path / "local" / "model.safetensors").read_bytes()
    else:
        assert _files(tmp_path / "out") == _files(tmp_path / "local")
    loaded = load_file(str(tmp_path / "local" / "model.safetensors"))
    cast_to = torch.bfloat16 if cast else torch.float32
    assert sorted(loaded) == sorted(weights) and all(torch.equal(loaded[n], t.to(cast_to)) for n, t in weights.items())


def test_torch_save_files_opened_at_once_from_a_store_fetch_each_header_block_about_once(tmp_path, monkeypatch):
    """8 `torch.save` files of 20 tensors, each tensor's zip header in a block of its own, opened
    8 at once (`open_each`, as DeepSpeed's rank files are) through the blocks their handles
    share: what each fetches ahead is read before the others' push it out, so they take about
    the reads that opening them one at a time takes (not ~1.8x), and hold what torch loads."""
    from fsdpkit.checkpoint.storage import handle
    from fsdpkit.checkpoint.storage.local import LocalStorage
    from fsdpkit.checkpoint.storage.stored_path import stored_root
    from fsdpkit.checkpoint.torchfile import savefile
    from fsdpkit.checkpoint.torchfile import unpickler as u

    monkeypatch.setattr(handle, "BLOCK_BYTES", 8192)  # small files, the same count of blocks
    monkeypatch.setattr(savefile, "LOCAL_HEADER_READ_BYTES", 512)
    for f in range(8):
        torch.save({f"t{i}": torch.full((2100,), float(f * 100 + i)) for i in range(20)}, tmp_path / f"f{f}.pt")
    reads: list[str] = []
    original = LocalStorage.read
    monkeypatch.setattr(LocalStorage, "read", lambda self, name, *a, **k: reads.append(name) or original(self, name, *a, **k))

    def opened_reads(at_once: int) -> int:
        monkeypatch.setattr(savefile, "OPENS_IN_FLIGHT", at_once)
        reads.clear()
        root = stored_root(LocalStorage(tmp_path), {p.name: p.stat().st_size for p in tmp_path.iterdir()})
        opened: list[savefile.SaveFile] = []
        loads = lambda raw, where: u.restricted_loads(raw, allowed=u.TENSOR_GLOBALS, where=where, storages=True)  # noqa: E731
        savefile.open_each([root / f"f{f}.pt" for f in range(8)], lambda _, path: savefile.SaveFile(path, loads), opened)
        for f, saved in enumerate(opened):
            expected, data = torch.load(tmp_path / f"f{f}.pt"), (tmp_path / f"f{f}.pt").read_bytes()
            found = {name: saved.tensor_range(record, name) for name, record in saved.state.items()}
            assert {name: data[r.offset : r.offset + 4 * r.numel] for name, r in found.items()} == {
                name: t.numpy().tobytes() for name, t in expected.items()
            }
            saved.close()
        return len(reads)

    one_at_a_time, at_once = opened_reads(1), opened_reads(8)
    assert at_once <= one_at_a_time * 1.25, (at_once, one_at_a_time)


def test_a_torch_save_zip_whose_records_point_past_its_end_is_named_as_on_disk(tmp_path):
    """A `torch.save` zip whose central directory puts its tensors' records past the end of the
    file: read from a store, the one-line error that reading it from disk gives (no request for
    bytes past the object's end first)."""
    import io
    import struct

    from fsdpkit.checkpoint.storage.local import LocalStorage
    from fsdpkit.checkpoint.storage.stored_path import stored_root
    from fsdpkit.checkpoint.torchfile import savefile
    from fsdpkit.checkpoint.torchfile import unpickler as u
    from fsdpkit.errors import DataCheckError

    saved = io.BytesIO()
    torch.save({f"t{i}": torch.ones(100_000) for i in range(3)}, saved)
    data, at, moved = bytearray(saved.getvalue()), 0, 0
    while (at := data.find(b"PK\x01\x02", at + 1)) >= 0:  # each central directory entry
        name = bytes(data[at + 46 : at + 46 + struct.unpack_from("<H", data, at + 28)[0]])
        if b"/data/" in name:
            struct.pack_into("<L", data, at + 42, 0x7FFFFFF0 - moved * 300_000)  # its local header's offset
            moved += 1
    assert moved == 3
    (tmp_path / "f.pt").write_bytes(data)
    stored = stored_root(LocalStorage(tmp_path), {"f.pt": len(data)}) / "f.pt"
    loads = lambda raw, where: u.restricted_loads(raw, allowed=u.TENSOR_GLOBALS, where=where, storages=True)  # noqa: E731
    messages = []
    for path in (tmp_path / "f.pt", stored):
        with pytest.raises(DataCheckError) as error:
            savefile.SaveFile(path, loads)
        messages.append(str(error.value))
    assert messages[1] == messages[0] and "truncated" in messages[0] and "\n" not in messages[0], messages


def test_files_opened_at_once_stop_at_the_first_failure_and_hand_back_every_one_opened(monkeypatch):
    """20 files opened 8 at once, the first failing once all 8 started, the others slow: the failure is
    raised, the 12 whose turn had not come are never opened, and every one opened is handed back
    to be closed."""
    import time

    from fsdpkit.checkpoint.torchfile import savefile
    from fsdpkit.errors import DataCheckError

    started: list[int] = []
    first = threading.Barrier(8)

    def open_one(number, path):
        started.append(number)
        if number < 8:
            first.wait(timeout=30)
        if number == 0:
            raise DataCheckError(f"{path}: not a readable torch.save zip")
        time.sleep(0.3)
        return number

    opened: list = []
    with pytest.raises(DataCheckError, match="rank0: not a readable"):
        savefile.open_each([Path(f"rank{n}") for n in range(20)], open_one, opened)
    assert sorted(started) == list(range(8)) and opened == list(range(1, 8)), (started, opened)
