"""Every bad input is detected before any weight is used: one line, the right exit code,
SRC untouched, no partial DST."""

from __future__ import annotations

import contextlib
import errno
import gc
import json
import os
import resource
import shutil
import struct
import subprocess
import sys
from collections import namedtuple
from pathlib import Path

import pytest
import torch
from support.checkpoint_files import SAMPLE_UNITS, run_cli, sample_buffers, sample_optimizer, sample_tensors, save_checkpoint, tree_snapshot
from support.checkpoint_v1 import write_v1

from fsdpkit.checkpoint.format import storage
from fsdpkit.checkpoint.format.manifest import check_compatible
from fsdpkit.checkpoint.format.reader import read_header
from fsdpkit.checkpoint.live.tensors import CheckpointReader
from fsdpkit.errors import DataCheckError

RANK1 = "rank-00001-of-00002.safetensors"


@pytest.fixture(scope="module")
def pristines(tmp_path_factory):
    """The same W=2 checkpoint in format 2 and format 1 (step directories)."""
    root = tmp_path_factory.mktemp("pristine")
    params = sample_tensors()
    tensors = {**params, **sample_buffers(), **sample_optimizer(params)}
    v1 = write_v1(root / "v1" / "step-00000004", tensors, world_size=2, units=SAMPLE_UNITS, training_state={"step": 4})
    (root / "v1" / "latest").write_text("step-00000004\n")
    return {2: save_checkpoint(root / "run", 4, tensors, world_size=2, units=SAMPLE_UNITS), 1: v1}


@pytest.fixture
def pristine(pristines):
    return pristines[2]


def _copy(pristine, tmp_path):
    run = tmp_path / "src"
    shutil.copytree(pristine.parent, run)
    return run


@pytest.fixture
def ckpt(pristine, tmp_path):
    """A fresh copy of a good W=2 checkpoint (run dir) to damage."""
    return _copy(pristine, tmp_path)


def _step(run):
    return run / "step-00000004"


def _manifest_edit(run, change):
    path = _step(run) / "manifest.json"
    document = json.loads(path.read_text())
    change(document)
    path.write_text(json.dumps(document))


def _flip_data_byte(run):
    """One bit of a model tensor's fragment in rank 1's file (headers and sizes stay valid)."""
    path = _step(run) / RANK1
    header = read_header(path)
    info = header.tensors["h.1.mlp.weight"]
    raw = bytearray(path.read_bytes())
    raw[header.data_start + info.begin + 5] ^= 0x01
    path.write_bytes(bytes(raw))


def _truncate(run):
    path = _step(run) / RANK1
    path.write_bytes(path.read_bytes()[:-9])


def _huge_header(run):
    path = _step(run) / RANK1
    raw = path.read_bytes()
    path.write_bytes(struct.pack("<Q", 2**63) + raw[8:])


def _outside(run):
    (run.parent / "evil.safetensors").write_bytes(b"x")
    _manifest_edit(run, lambda d: d["files"][1].update(name="../evil.safetensors"))


def _symlink_out(run):
    target = run.parent / "elsewhere.safetensors"
    shutil.copy(_step(run) / RANK1, target)
    (_step(run) / RANK1).unlink()
    (_step(run) / RANK1).symlink_to(target)


def _gap(run):
    def change(document):
        tensor = next(t for t in document["tensors"] if len(t["fragments"]) == 2)
        tensor["fragments"][1]["start"] += 1

    _manifest_edit(run, change)


def _header_dtype(run):
    def change(document):
        tensor = next(t for t in document["tensors"] if t["dtype"] == "F32")
        tensor["dtype"] = "F16"

    _manifest_edit(run, change)


def _table_dtype(run):
    _manifest_edit(run, lambda d: d["tensors"][0].__setitem__(1, "F16"))


def _fifo(run):
    (_step(run) / RANK1).unlink()
    os.mkfifo(_step(run) / RANK1)


def _nested_manifest(run):
    (_step(run) / "manifest.json").write_text("[" * 100_000 + "]" * 100_000)


def _move_param(run):
    """Move a parameter to another unit: the layout the plan gives no longer matches the files."""

    def change(document):
        units = document["placement"]["units"]
        units[1].append(units[0].pop())

    _manifest_edit(run, change)


Case = namedtuple("Case", "damage message")
COMMON = {
    "flipped byte": Case(_flip_data_byte, "checksum mismatch"),
    "truncated file": Case(_truncate, RANK1),
    "missing rank file": Case(lambda run: (_step(run) / RANK1).unlink(), f"{RANK1}: file is missing"),
    "symlink outside": Case(_symlink_out, "symlink points outside"),
    "huge header": Case(_huge_header, "header claims 9223372036854775808 bytes"),
    "fifo": Case(_fifo, f"{RANK1}: not a regular file"),
    "extra file": Case(lambda run: (_step(run) / "rank-00002-of-00002.safetensors").write_bytes(b"x"), "does not account for"),
    "manifest not json": Case(lambda run: (_step(run) / "manifest.json").write_text("{oops"), "not valid JSON"),
    "manifest nested": Case(_nested_manifest, "nested deeper than 64 levels"),
    "unknown version": Case(lambda run: _manifest_edit(run, lambda d: d.update(version=99)), "format version 99"),
    "latest garbage": Case(lambda run: (run / "latest").write_text("../../etc"), "expected a step directory name"),
    "latest dangling": Case(lambda run: shutil.rmtree(_step(run)), "names step-00000004, which is missing"),
}
CASES = {
    2: {
        **COMMON,
        "naming rule outside": Case(
            lambda run: _manifest_edit(run, lambda d: d.update(files="../evil-{rank}")), "file naming rule '../evil-{rank}' is not"
        ),
        "another format": Case(
            lambda run: _manifest_edit(run, lambda d: d.update(format="other")), "format is 'other', expected 'fsdpkit-checkpoint'"
        ),
        "edited plan": Case(_move_param, "the layout the manifest gives"),
        "dtype edited": Case(_table_dtype, "the layout the manifest gives"),
        "world size edited": Case(
            lambda run: _manifest_edit(run, lambda d: d.update(world_size=3)), "rank-00000-of-00003.safetensors: file is missing"
        ),
        "shape edited": Case(
            lambda run: _manifest_edit(run, lambda d: d["tensors"][1][2].__setitem__(0, 4)), "the layout the manifest gives"
        ),
    },
    1: {
        **COMMON,
        "path outside": Case(_outside, "'../evil.safetensors' is not a plain file name"),
        "coverage gap": Case(_gap, "gap, overlap or empty"),
        "dtype disagrees": Case(_header_dtype, "has dtype F32, the manifest says F16"),
        "file size edited": Case(lambda run: _manifest_edit(run, lambda d: d["files"][0].update(size=5)), "the manifest says 5"),
    },
}


@pytest.mark.parametrize(
    "version, case", [(v, name) for v in CASES for name in CASES[v]], ids=[f"v{v}-{name}" for v in CASES for name in CASES[v]]
)
def test_every_command_rejects_bad_checkpoint(pristines, tmp_path, version, case):
    ckpt = _copy(pristines[version], tmp_path)
    damage, message = CASES[version][case]
    damage(ckpt)
    before = tree_snapshot(ckpt)
    commands = [
        ("verify", ckpt),
        ("inspect", ckpt),
        ("convert", ckpt, tmp_path / "out", "--to", "full"),
        ("reshard", ckpt, tmp_path / "out", "--world-size", "3"),
    ]
    if case == "flipped byte":
        commands.remove(("inspect", ckpt))  # inspect reads headers only; checksums are verify's and every reader's job
    for command in commands:
        result = run_cli(*command)
        assert result.exit_code == 3, (command, result.output)
        line = result.stderr.strip()
        assert line.startswith("error: ") and "\n" not in line and message in line, (command, line)
        assert "Traceback" not in result.output
    assert tree_snapshot(ckpt) == before
    extra = {"symlink outside": ["elsewhere.safetensors"], "path outside": ["evil.safetensors"]}.get(case, [])
    _no_leftovers(tmp_path, ["src"] + extra)


NOT_A_CHECKPOINT = "not a checkpoint fsdpkit reads (fsdpkit, Megatron, DCP, DeepSpeed, verl, full safetensors)"


def test_a_directory_that_is_no_checkpoint_is_bad_input(tmp_path):
    """Exit 2 and one line naming every format read, from every command that reads a checkpoint
    (a checkpoint that fails its checks exits 3, above); the installed command exits alike."""
    empty, text = tmp_path / "empty", tmp_path / "notes.txt"
    empty.mkdir()
    text.write_text("hello")
    for path in (empty, text):
        for command in (
            ("verify", path),
            ("inspect", path),
            ("convert", path, tmp_path / "out", "--to", "full"),
            ("reshard", path, tmp_path / "out", "--world-size", "2"),
            ("diff", path, path),
            ("train", "--model", "gpt-tiny", "--resume", path, "--steps", "1"),
        ):
            result = run_cli(*command)
            assert result.exit_code == 2, (command, result.output)
            assert result.stderr.strip() == f"error: {path}: {NOT_A_CHECKPOINT}", (command, result.stderr)
    fsdpkit = Path(sys.executable).parent / "fsdpkit"
    installed = subprocess.run([fsdpkit, "inspect", empty], capture_output=True, text=True, timeout=120)
    assert installed.returncode == 2 and installed.stderr.strip() == f"error: {empty}: {NOT_A_CHECKPOINT}", installed
    assert sorted(p.name for p in tmp_path.iterdir()) == ["empty", "notes.txt"]


def test_a_step_directory_holding_a_model_safetensors_is_fsdpkits_and_refused(pristines, tmp_path):
    """The manifest makes a directory fsdpkit's checkpoint, whatever else it holds: a
    model.safetensors beside it is a file the manifest does not account for, not a full
    checkpoint to read instead."""
    step = _step(_copy(pristines[2], tmp_path))
    shutil.copy(step / RANK1, step / "model.safetensors")
    for command in (("verify", step), ("convert", step, tmp_path / "out", "--to", "dcp")):
        result = run_cli(*command)
        assert result.exit_code == 3 and "does not account for: ['model.safetensors']" in result.stderr, (command, result.output)
    assert not (tmp_path / "out").exists()


def test_reshard_of_a_format_without_ranks_says_what_to_do(ckpt, tmp_path):
    assert run_cli("convert", ckpt, tmp_path / "full", "--to", "full").exit_code == 0
    result = run_cli("reshard", tmp_path / "full", tmp_path / "out", "--world-size", "2")
    assert result.exit_code == 2 and not (tmp_path / "out").exists()
    expected = (
        f"error: {tmp_path / 'full'}: a full safetensors checkpoint has no ranks to lay out:"
        " convert it --to sharded, megatron, dcp or deepspeed"
    )
    assert result.stderr.strip() == expected


def test_a_checkpoint_that_fails_its_checks_exits_3(ckpt):
    _flip_data_byte(ckpt)
    installed = subprocess.run([Path(sys.executable).parent / "fsdpkit", "verify", ckpt], capture_output=True, text=True, timeout=120)
    assert installed.returncode == 3 and "checksum mismatch" in installed.stderr, installed


def test_reader_detects_flipped_byte_before_use(ckpt):
    _flip_data_byte(ckpt)
    reader = CheckpointReader(ckpt)  # headers and sizes are fine
    corrupt = [t.name for t in reader.manifest.tensors if any(file == RANK1 for file, _ in reader.fragments(t.name))]
    with pytest.raises(DataCheckError, match="checksum mismatch"):
        for name in corrupt:
            reader.read_tensor(name)


def test_verify_lists_every_problem(ckpt):
    _flip_data_byte(ckpt)
    (_step(ckpt) / "rank-00000-of-00002.safetensors").write_bytes(b"")
    result = run_cli("verify", ckpt, "--json")
    assert result.exit_code == 3
    report = json.loads(result.stdout)
    assert report["ok"] is False and len(report["problems"]) == 2
    assert any("checksum mismatch" in p for p in report["problems"]) and any("truncated" in p for p in report["problems"])


def test_verify_reads_files_whole_or_in_blocks_alike(ckpt, monkeypatch):
    """Small rank files are read whole, large ones a block at a time: a flipped byte and the
    byte count come out the same either way, with blocks that cut fragments anywhere."""
    from fsdpkit.checkpoint.format import verify

    _flip_data_byte(ckpt)
    whole = verify.verify_checkpoint(ckpt)
    monkeypatch.setattr(verify, "WHOLE_FILE_BYTES", 0)
    advanced: list[int] = []
    blocks = verify.verify_checkpoint(ckpt, chunk_size=7, progress=lambda done, total: advanced.append(done))
    assert whole.problems == blocks.problems and len(blocks.problems) == 1
    assert f"{RANK1}: checksum mismatch in tensor 'h.1.mlp.weight'" in blocks.problems[0]
    assert whole.bytes == blocks.bytes == sum(advanced) > 0


def test_checkpoint_of_another_model(pristine):
    manifest = CheckpointReader(pristine).manifest
    shapes = {t.name: t.shape for t in manifest.tensors}
    with pytest.raises(DataCheckError, match=r"shapes differ from the model: wte.weight \[17, 8\] vs model \[18, 8\]"):
        check_compatible(manifest, {**shapes, "wte.weight": (18, 8)})
    with pytest.raises(DataCheckError, match=r"missing model tensors \['h.2.attn.weight'\]"):
        check_compatible(manifest, {**shapes, "h.2.attn.weight": (8, 8)})
    with pytest.raises(DataCheckError, match=r"does not have: \['ln_f.weight'\]"):
        check_compatible(manifest, {n: s for n, s in shapes.items() if n != "ln_f.weight"})
    optim = {**shapes, "optim.momentum_buffer.wte.weight": (17, 8)}
    with pytest.raises(DataCheckError, match="missing optimizer state"):
        check_compatible(manifest, optim, strict=True)
    assert check_compatible(manifest, optim, strict=False) == ["optim.momentum_buffer.wte.weight"]


def _no_leftovers(directory, allowed):
    assert sorted(p.name for p in directory.iterdir()) == sorted(allowed)


@pytest.mark.parametrize(
    "args, code, message",
    [
        (("convert", "{src}", "{src}/inner", "--to", "full"), 2, "is inside the source"),
        (("reshard", "{src}", "{src}/step-00000004/x", "--world-size", "2"), 2, "is inside the source"),
        (("convert", "{src}", "{tmp}/out", "--to", "fuller"), 2, "unknown --to 'fuller'"),
        (("reshard", "{src}", "{tmp}/out", "--world-size", "0"), 2, "--world-size must be >= 1, got 0"),
        (("reshard", "{src}", "{tmp}/out", "--world-size", "-3"), 2, "--world-size must be >= 1, got -3"),
        (("reshard", "{src}", "{tmp}/out"), 2, "--world-size is required"),
        (("convert", "{src}", "{tmp}/out", "--to", "full", "--chunk-size", "12Q"), 2, "unknown size unit"),
        (("convert", "{tmp}/nothing", "{tmp}/out", "--to", "full"), 2, "does not exist"),
        (("convert", "{src}", "{tmp}/" + "d" * 238, "--to", "full"), 2, "is 238 bytes long: at most 237"),
        (("reshard", "{src}", "{tmp}/" + "d" * 256, "--world-size", "2", "--nproc-per-node", "2"), 2, "is 256 bytes long: at most 237"),
        (
            ("convert", "{src}", "{tmp}/out", "--to", "sharded", "--world-size", "2"),
            2,
            "a sharded checkpoint cannot be converted --to sharded",
        ),
        (("convert", "{src}/step-00000004/manifest.json", "{tmp}/out", "--to", "sharded", "--world-size", "2"), 3, "no weight_map"),
    ],
)
def test_usage_errors(ckpt, tmp_path, args, code, message):
    before = tree_snapshot(ckpt)
    result = run_cli(*(a.format(src=ckpt, tmp=tmp_path) for a in args))
    assert result.exit_code == code, result.output
    assert message in result.stderr and result.stderr.count("\n") == 1
    assert tree_snapshot(ckpt) == before
    _no_leftovers(tmp_path, ["src"])


@pytest.mark.parametrize("command", [("reshard", "--world-size", "3"), ("convert", "--to", "full")])
def test_a_destination_that_appears_while_a_command_runs_is_left_as_it_is(ckpt, tmp_path, monkeypatch, command):
    """Another process makes DST after the command checked it (a second command with the same
    DST, say): without --overwrite the command stops with one line and DST keeps what it holds."""
    from fsdpkit.checkpoint.core import staging

    dst = tmp_path / "out"
    synced = staging.sync_files

    def sync_and_someone_makes_dst(directory, names):
        synced(directory, names)
        dst.mkdir(exist_ok=True)
        (dst / "mine.txt").write_text("keep me")

    monkeypatch.setattr(staging, "sync_files", sync_and_someone_makes_dst)
    result = run_cli(command[0], ckpt, dst, *command[1:])
    assert result.exit_code == 2, result.output
    assert f"destination {dst} appeared while the conversion ran; pass --overwrite" in result.stderr and result.stderr.count("\n") == 1
    assert [p.name for p in dst.iterdir()] == ["mine.txt"] and (dst / "mine.txt").read_text() == "keep me"
    _no_leftovers(tmp_path, ["src", "out"])


def test_existing_destination_needs_overwrite(ckpt, tmp_path):
    dst = tmp_path / "out"
    dst.mkdir()
    (dst / "old.txt").write_text("keep me")
    result = run_cli("reshard", ckpt, dst, "--world-size", "3")
    assert result.exit_code == 2 and "already exists; pass --overwrite" in result.stderr
    assert (dst / "old.txt").read_text() == "keep me"
    assert run_cli("reshard", ckpt, dst, "--world-size", "3", "--overwrite").exit_code == 0
    assert not (dst / "old.txt").exists() and (dst / "manifest.json").exists()
    _no_leftovers(tmp_path, ["src", "out"])
    assert run_cli("reshard", dst, ckpt, "--world-size", "1", "--overwrite").exit_code == 0  # replacing SRC's own run is fine
    bad = run_cli("reshard", dst, tmp_path, "--world-size", "1", "--overwrite")
    assert bad.exit_code == 2 and "contains the source" in bad.stderr


def test_not_enough_disk_space(ckpt, tmp_path, monkeypatch):
    usage = namedtuple("usage", "total used free")
    monkeypatch.setattr(storage.shutil, "disk_usage", lambda path: usage(10**9, 10**9 - 100, 100))
    result = run_cli("convert", ckpt, tmp_path / "out", "--to", "full")
    assert result.exit_code == 1 and "not enough disk space" in result.stderr and "100 B free" in result.stderr
    _no_leftovers(tmp_path, ["src"])


def test_interrupted_convert_leaves_no_partial_destination(ckpt, tmp_path, monkeypatch):
    from fsdpkit.checkpoint.core import bytecopy

    calls = {"n": 0}
    original = bytecopy.ByteEngine._view

    def failing(self, *args):
        calls["n"] += 1
        if calls["n"] == 10:
            raise KeyboardInterrupt
        return original(self, *args)

    monkeypatch.setattr(bytecopy.ByteEngine, "_view", failing)
    result = run_cli("convert", ckpt, tmp_path / "out", "--to", "full")
    assert result.exit_code == 130
    _no_leftovers(tmp_path, ["src"])


@pytest.mark.parametrize("error", [KeyboardInterrupt, DataCheckError])
def test_error_while_reading_leaves_no_partial_destination(ckpt, tmp_path, monkeypatch, error):
    """With 64-byte chunks every tensor takes several blocks: an error while reading one
    reaches the caller and the staged output is removed."""
    from fsdpkit.checkpoint.core import bytecopy
    from fsdpkit.checkpoint.core.request import ConvertRequest
    from fsdpkit.checkpoint.offline.formats import convert_any

    calls = {"n": 0}
    original = bytecopy.ByteEngine._view

    def failing(self, *args):
        calls["n"] += 1
        if calls["n"] == 25:
            raise error("injected")
        return original(self, *args)

    monkeypatch.setattr(bytecopy.ByteEngine, "_view", failing)
    with pytest.raises(error):
        convert_any(ckpt, tmp_path / "out", ConvertRequest(to="full", chunk_size=64))
    _no_leftovers(tmp_path, ["src"])


@pytest.mark.parametrize("streamed", [False, True])
def test_failed_write_fails_the_reshard(ckpt, tmp_path, monkeypatch, streamed):
    """Large rank files are written by worker threads: a write failing there (no space) ends
    the reshard with one line naming it, exit 1, nothing is left and no descriptor stays open;
    as for small files, written whole by the main thread."""
    from fsdpkit.checkpoint.core import bytecopy, files

    calls = {"n": 0}

    def failing(*args):
        calls["n"] += 1
        if calls["n"] == 2:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), "injected")
        return original(*args)

    if streamed:
        monkeypatch.setattr(bytecopy, "KERNEL_COPY_BYTES", 64)
        monkeypatch.setattr(bytecopy, "WHOLE_FILE_BYTES", 256)
        original = files.copy_range
        monkeypatch.setattr(files, "copy_range", failing)
    else:
        original = bytecopy.write_file
        monkeypatch.setattr(bytecopy, "write_file", failing)
    gc.collect()  # descriptors that earlier tests left to the collector (tensors received from workers) close now, not midway
    open_before = len(os.listdir("/proc/self/fd"))
    result = run_cli("reshard", ckpt, tmp_path / "out", "--world-size", "3")
    assert result.exit_code == 1, result.output
    assert "No space left on device" in result.output and "Traceback" not in result.output
    assert calls["n"] >= 2
    del result
    gc.collect()  # the traceback kept in the result holds the engine's mappings (each holds a descriptor)
    assert len(os.listdir("/proc/self/fd")) == open_before  # every descriptor closed, queued copies' too
    _no_leftovers(tmp_path, ["src"])


@contextlib.contextmanager
def _tmpfs(path, options):
    """A small tmpfs at `path` when this process may mount one (root, and allowed); else None."""
    path.mkdir()
    if (
        os.geteuid() != 0
        or subprocess.run(["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(path)], capture_output=True).returncode != 0
    ):
        yield None
        return
    try:
        yield path
    finally:
        subprocess.run(["umount", str(path)], check=True)


def _one_line_run_error(result, *needles):
    line = result.stderr.strip()
    assert result.exit_code == 1 and line.startswith("error: ") and "\n" not in line, result.output
    assert all(needle in line for needle in needles), line


def _one_line_usage_error(result, *needles):
    line = result.stderr.strip()
    assert result.exit_code == 2 and line.startswith("error: ") and "\n" not in line, result.output
    assert all(needle in line for needle in needles), line


def test_full_read_only_or_size_limited_destination(ckpt, tmp_path, monkeypatch):
    """Convert/reshard into a destination that fails (no space, no inodes, file size limit):
    one line naming the path and the errno, exit 1, nothing left behind; read-only: exit 2."""
    from fsdpkit.checkpoint.format import writer

    with _tmpfs(tmp_path / "full", "size=1m,nr_inodes=4") as full:  # room for the directory and two files
        if full is None:  # no small filesystem to be had: the same error, injected

            def no_space(path, data, sync):
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(path))

            monkeypatch.setattr(writer, "_write_whole", no_space)
            full = tmp_path / "full"
        _one_line_run_error(run_cli("reshard", ckpt, full / "out", "--world-size", "8"), "No space left on device (ENOSPC)", str(full))
        monkeypatch.undo()
        assert list(full.iterdir()) == []
    with _tmpfs(tmp_path / "ro", "ro,size=16m") as read_only:
        if read_only is None:
            read_only = tmp_path / "ro"
            if os.geteuid() == 0:  # root writes through permissions: inject what a read-only mount says
                monkeypatch.setattr(
                    storage.Path,
                    "mkdir",
                    lambda self, *a, **k: (_ for _ in ()).throw(OSError(errno.EROFS, os.strerror(errno.EROFS), str(self))),
                )
            else:
                read_only.chmod(0o555)
        result = run_cli("convert", ckpt, read_only / "out", "--to", "full")
        monkeypatch.undo()
        _one_line_usage_error(result, f"destination directory {read_only} is read-only", "(EROFS)" if os.geteuid() == 0 else "(EACCES)")
        assert list(read_only.iterdir()) == []
    big = save_checkpoint(tmp_path / "big", 1, {"w": torch.randn(40_000)}, world_size=2)
    limited = subprocess.run(
        [
            sys.executable,
            "-c",
            "from fsdpkit_cli.app import main; main()",
            "reshard",
            str(big),
            str(tmp_path / "limited" / "out"),
            "--world-size",
            "1",
        ],
        capture_output=True,
        text=True,
        preexec_fn=lambda: resource.setrlimit(resource.RLIMIT_FSIZE, (100_000, 100_000)),
    )
    line = limited.stderr.strip()
    assert limited.returncode == 1 and line.startswith("error: ") and "\n" not in line and "(EFBIG)" in line, limited.stderr
    assert "rank-00000-of-00001.safetensors" in line and list((tmp_path / "limited").iterdir()) == []


def test_read_only_or_impossibly_small_destination_is_a_usage_error(ckpt, tmp_path, monkeypatch):
    """A read-only filesystem with little room (once reported as "not enough disk space"), and
    --world-size beyond what the whole disk holds: exit 2, one line, nothing written."""
    with _tmpfs(tmp_path / "ro", "ro,size=4k") as read_only:
        if read_only is None:  # no filesystem to mount: what a read-only one answers, injected
            read_only = tmp_path / "ro"
            monkeypatch.setattr(storage.os, "access", lambda path, mode: False)
            monkeypatch.setattr(storage.os, "statvfs", lambda path: os.statvfs_result((0,) * 8 + (os.ST_RDONLY, 255)))
        for command in (
            ["convert", ckpt, read_only / "out", "--to", "full"],
            ["reshard", ckpt, read_only / "run" / "out", "--world-size", "3"],
        ):
            result = run_cli(*command)
            _one_line_usage_error(result, f"destination directory {read_only} is read-only: a read-only filesystem (EROFS)")
        monkeypatch.undo()
        assert list(read_only.iterdir()) == []
    src = tree_snapshot(ckpt)
    result = run_cli("reshard", ckpt, tmp_path / "out", "--world-size", str(10**12))
    _one_line_usage_error(result, "cannot fit", "--world-size 1000000000000", "whole filesystem holds")
    assert tree_snapshot(ckpt) == src
    assert run_cli("convert", ckpt, tmp_path / "full", "--to", "full").exit_code == 0
    result = run_cli("convert", tmp_path / "full", tmp_path / "out", "--to", "sharded", "--world-size", str(10**12))
    _one_line_usage_error(result, "cannot fit", "--world-size 1000000000000", "whole filesystem holds")
    _no_leftovers(tmp_path, ["src", "ro", "full"])


def test_malformed_full_checkpoints_are_one_line(tmp_path):
    """A safetensors header or an index nested 100,000 deep, or a FIFO in place of the file: one
    line, exit 3, no RecursionError, nothing blocks, nothing written."""
    deep = b"[" * 100_000 + b"]" * 100_000
    cases = {
        "header": ("model.safetensors", struct.pack("<Q", len(deep)) + deep, "nested deeper than 64 levels"),
        "index": ("model.safetensors.index.json", deep, "nested deeper than 64 levels"),
        "fifo": ("model.safetensors", None, "not a regular file"),
    }
    for case, (name, content, message) in cases.items():
        src = tmp_path / case
        src.mkdir()
        if content is None:
            os.mkfifo(src / name)
        else:
            (src / name).write_bytes(content)
        for command in (("convert", src, tmp_path / "out", "--to", "sharded", "--world-size", "2"), ("inspect", src), ("verify", src)):
            result = run_cli(*command)
            line = result.stderr.strip()
            assert result.exit_code == 3 and "\n" not in line and message in line, (case, command, result.output)
    assert not (tmp_path / "out").exists()


def test_destination_under_a_regular_file_names_the_file(pristine, tmp_path):
    """A destination below a regular file, for every writer (full, sharded, DCP, DeepSpeed): one
    line naming that file, exit 2, nothing written (once: "is read-only: no write permission")."""
    blocker = tmp_path / "afile"
    blocker.write_text("not a directory\n")
    for command in (
        ["convert", pristine, blocker / "out", "--to", "full"],
        ["convert", pristine, blocker / "deeper" / "out", "--to", "dcp"],
        ["convert", pristine, blocker / "out", "--to", "deepspeed", "--stage", "2"],
        ["reshard", pristine, blocker / "out", "--world-size", "3"],
    ):
        result = run_cli(*command)
        _one_line_usage_error(result, f"{blocker} is a file, not a directory")
        assert "read-only" not in result.stderr
    assert blocker.read_text() == "not a directory\n" and sorted(p.name for p in tmp_path.iterdir()) == ["afile"]
