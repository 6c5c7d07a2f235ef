"""convert --to full, reshard and verify spread over 1, 2 and 4 processes: the same bytes as the
one-process commands and as the tensors the test wrote (read back by safetensors); a failing or
killed rank commits nothing; the same command again continues, re-reading only what was not
finished; bad input is refused before any rank writes."""

from __future__ import annotations

import json
import os
import re
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file
from support.checkpoint_files import run_cli, save_checkpoint, tree_snapshot

from fsdpkit.checkpoint.spread.staging import staging_path
from fsdpkit.dist.faults import FAULT_ENV

SHARD = "150KB"


def _tensors() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    model = {f"layer.{i}.weight": torch.randn(40 + 9 * i, 64, generator=g) for i in range(24)}
    model["ids"] = torch.arange(100, dtype=torch.int64)
    optim = {f"optim.exp_avg.{n}": torch.randn(t.shape, generator=g) for n, t in model.items() if n.startswith("layer")}
    optim |= {f"optim.exp_avg_sq.{n}": torch.rand(t.shape, generator=g) for n, t in model.items() if n.startswith("layer")}
    return {**model, **optim}


@pytest.fixture(scope="module")
def source(tmp_path_factory):
    root = tmp_path_factory.mktemp("spread")
    tensors = _tensors()
    save_checkpoint(root / "run", 5, tensors, world_size=4, training_state={"step": 5})
    clean = root / "clean"
    result = run_cli("convert", root / "run", clean, "--to", "full", "--max-shard-size", SHARD, "--with-optimizer")
    assert result.exit_code == 0, result.output
    return root, tensors, clean


def _files(directory: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(directory.iterdir())}


def _convert(src, dst, *flags, env=None):
    args = ["convert", src, dst, "--to", "full", "--max-shard-size", SHARD, "--with-optimizer", "--json", *flags]
    return run_cli(*args) if env is None else _with_env(env, args)


def _with_env(env: dict, args: list):
    old = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        return run_cli(*args)
    finally:
        for k, v in old.items():
            os.environ.pop(k) if v is None else os.environ.__setitem__(k, v)


def _loaded(directory: Path) -> dict[str, torch.Tensor]:
    out = {}
    for path in sorted(directory.glob("*.safetensors")):
        out.update(load_file(path))
    return out


def test_full_output_is_the_same_bytes_from_1_2_and_4_processes(source, tmp_path):
    root, tensors, clean = source
    expected = _files(clean)
    for nproc in (1, 2, 4):
        result = _convert(root / "run", tmp_path / f"n{nproc}", "--nproc-per-node", str(nproc))
        assert result.exit_code == 0, result.output
        assert _files(tmp_path / f"n{nproc}") == expected, nproc
        spread = json.loads(result.stdout)["spread"]
        assert spread["world_size"] == nproc and len(spread["ranks"]) == nproc
        assert spread["largest_share_vs_mean"] <= 1.1
        ranks, written = spread["ranks"], sum(p.stat().st_size for p in (tmp_path / f"n{nproc}").glob("*.safetensors"))
        assert [r["rank"] for r in ranks] == list(range(nproc)) and all(r["share_bytes"] == r["bytes_planned"] > 0 for r in ranks)
        assert sum(r["share_bytes"] for r in ranks) == written and max(r["share_bytes"] for r in ranks) * nproc <= 1.1 * written
        assert sum(r["parts"] for r in ranks) >= len(list(clean.glob("*.safetensors"))) and not any(r["kept"] for r in ranks), ranks
        assert spread["bytes_read"] == sum(r["bytes_read"] for r in ranks) and all(r["bytes_read"] > 0 for r in ranks), spread
    loaded = _loaded(tmp_path / "n4")  # the oracle: the tensors the test wrote, read by safetensors
    assert set(loaded) == set(tensors)
    assert all(torch.equal(loaded[n], t) for n, t in tensors.items())
    assert not any(p.name.startswith(".tmp-") for p in tmp_path.iterdir())


def test_a_file_larger_than_a_fair_share_is_cut_across_ranks(source, tmp_path):
    """Files cut over 4 ranks, the run killed: a dry run of 2 ranks, which cut them otherwise,
    keeps only the records of its own parts; the rerun of 4 keeps every record and gives the
    one-process bytes. A single-file output is not cut, and the plan says why."""
    root, tensors, _ = source
    args = ("convert", root / "run", tmp_path / "out", "--to", "full", "--max-shard-size", "400KB", "--json")
    plain = run_cli(*args[:2], tmp_path / "plain", *args[3:])
    assert plain.exit_code == 0, plain.output
    dry = run_cli(*args, "--nproc-per-node", "4", "--dry-run")
    assert dry.exit_code == 0, dry.output
    planned = json.loads(dry.stdout)
    assert sum(len(r["parts"]) for r in planned["ranks"]) > len(json.loads(plain.stdout)["files"]) - 1  # more parts than files
    assert planned["largest_share_vs_mean"] <= 1.1 and planned["predicted_seconds"] >= 0
    assert not (tmp_path / "out").exists() and not staging_path(tmp_path / "out").exists()
    killed = _with_env({FAULT_ENV: "kill:1:2:convert"}, [*args, "--nproc-per-node", "4"])
    assert killed.exit_code == 1 and not (tmp_path / "out").exists(), killed.output
    records = {(r["name"], r["begin"], r["end"]) for r in _records(staging_path(tmp_path / "out"))}
    assert f"; {len(records)} of " in killed.output, killed.output  # counted once the 3 other ranks had stopped
    two = json.loads(run_cli(*args, "--nproc-per-node", "2", "--dry-run").stdout)
    labels = {label for rank in two["ranks"] for label in rank["parts"]}
    assert two["kept_parts"] == sum(f"{name} bytes [{begin}, {end})" in labels for name, begin, end in records) < len(records)
    result = run_cli(*args, "--nproc-per-node", "4")
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout)["spread"]["kept_parts"] == len(records) > 0
    assert _files(tmp_path / "out") == _files(tmp_path / "plain")
    single = run_cli("convert", root / "run", tmp_path / "one", "--to", "full", "--nproc-per-node", "2", "--dry-run")
    assert single.exit_code == 0 and "cannot be split" in single.stdout and "model.safetensors" in single.stdout
    assert single.stdout.startswith("plan: 1 file, ") and "over 2 ranks" in single.stdout and "rank 0: 1 part, " in single.stdout
    assert "(--max-shard-size cuts it into files)" in single.stdout
    given = run_cli(
        "convert", root / "run", tmp_path / "one", "--to", "full", "--max-shard-size", "5GB", "--nproc-per-node", "2", "--dry-run"
    )
    assert given.exit_code == 0 and "cannot be split" in given.stdout and "(--max-shard-size cuts it" not in given.stdout, given.output
    assert "it all fits in the --max-shard-size given: a smaller one cuts it into files" in given.stdout, given.output


def test_deepspeed_and_dcp_sources_give_the_one_process_bytes(source, tmp_path):
    """DeepSpeed ZeRO-3 (every tensor cut over its ranks: pieces read in part by several ranks)
    and DCP sources, written by fsdpkit from the test's tensors."""
    root, tensors, _ = source
    for target, flags in (("deepspeed", ("--stage", "3", "--world-size", "2")), ("dcp", ("--world-size", "2"))):
        made = run_cli("convert", root / "run", tmp_path / target, "--to", target, *flags)
        assert made.exit_code == 0, made.output
    cases = (("deepspeed", ("--dtype", "bf16", "--max-shard-size", "100KB"), "3"), ("dcp", ("--max-shard-size", SHARD), "2"))
    for name, flags, nproc in cases:
        one = run_cli("convert", tmp_path / name, tmp_path / f"{name}-1", "--to", "full", *flags)
        assert one.exit_code == 0, one.output
        spread = run_cli("convert", tmp_path / name, tmp_path / f"{name}-n", "--to", "full", *flags, "--nproc-per-node", nproc, "--json")
        assert spread.exit_code == 0, spread.output
        assert _files(tmp_path / f"{name}-n") == _files(tmp_path / f"{name}-1"), name
        opened = [rank["opened_source"] for rank in json.loads(spread.stdout)["spread"]["ranks"]]
        assert opened == [True] + [name == "dcp"] * (int(nproc) - 1), (name, opened)  # DeepSpeed's tensors are handed by rank 0
    loaded = _loaded(tmp_path / "dcp-n")
    assert all(torch.equal(loaded[n], t) for n, t in tensors.items() if not n.startswith("optim."))


def test_reshard_and_verify_spread_over_two_processes(source, tmp_path):
    root, _, _ = source
    plain = run_cli("reshard", root / "run", tmp_path / "plain", "--world-size", "3")
    assert plain.exit_code == 0, plain.output
    result = run_cli("reshard", root / "run", tmp_path / "out", "--world-size", "3", "--nproc-per-node", "2", "--json")
    assert result.exit_code == 0, result.output
    assert _files(tmp_path / "out") == _files(tmp_path / "plain")
    verified = run_cli("verify", tmp_path / "out", "--nproc-per-node", "2", "--json")
    assert verified.exit_code == 0, verified.output
    report = json.loads(verified.stdout)
    assert report["ok"] and report["spread"]["world_size"] == 2
    victim = tmp_path / "out" / "rank-00002-of-00003.safetensors"
    data = bytearray(victim.read_bytes())
    data[-5] ^= 0xFF
    victim.write_bytes(bytes(data))
    broken = run_cli("verify", tmp_path / "out", "--nproc-per-node", "2")
    assert broken.exit_code == 3 and "rank-00002-of-00003.safetensors" in broken.output and "checksum mismatch" in broken.output


def test_a_corrupt_tensor_read_in_parts_by_two_ranks_is_not_committed(tmp_path):
    """A byte flipped in the middle of a tensor whose output file is cut between two ranks: no
    rank reads the whole tensor, so rank 0's commit checks the checksums of its parts combined;
    one line naming the source file, exit 3, and DST is not there."""
    g = torch.Generator().manual_seed(3)
    tensors = {"big": torch.randn(96, 128, generator=g), **{f"small.{i}": torch.randn(32, 64, generator=g) for i in range(3)}}
    step = save_checkpoint(tmp_path / "run", 1, tensors, world_size=1)
    rank_file = step / "rank-00000-of-00001.safetensors"
    data = bytearray(rank_file.read_bytes())
    big = tensors["big"].numpy().tobytes()
    data[data.find(big) + len(big) // 2] ^= 0xFF
    rank_file.write_bytes(bytes(data))
    args = ("convert", step, tmp_path / "out", "--to", "full", "--max-shard-size", "20KB", "--nproc-per-node", "2")
    planned = json.loads(run_cli(*args, "--dry-run", "--json").stdout)
    owners = {rank["rank"] for rank in planned["ranks"] for label in rank["parts"] if label.startswith("model-00001-of-00003.safetensors")}
    assert owners == {0, 1}, planned  # the file of "big" (48 KiB of about 72), cut between both ranks
    corrupt = run_cli(*args)
    lines = [line for line in corrupt.output.splitlines() if line.strip()]
    assert corrupt.exit_code == 3 and len(lines) == 1, corrupt.output
    assert lines[0].startswith(f"error: {rank_file}: checksum mismatch in ") and "tensor 'big'" in lines[0], corrupt.output
    assert f"; nothing committed; repair {step} (`fsdpkit verify {step}` names what is damaged), then run " in lines[0], lines
    assert not (tmp_path / "out").exists()


def test_a_corrupt_source_is_to_be_repaired_before_the_rerun_which_then_needs_restart(source, tmp_path):
    """A byte flipped in a tensor of a source rank file: the line says to repair SRC (verify names
    what is damaged) and then to run again with --restart, which is what works: the rerun of the
    damaged source fails alike, the repaired source (its file rewritten) is another conversion,
    and --restart then writes the one-process bytes."""
    import struct

    root, _, clean = source
    src, dst = tmp_path / "run", tmp_path / "out"
    shutil.copytree(root / "run", src)
    victim = next((src / "step-00000005").glob("rank-00002-*.safetensors"))
    data = bytearray(victim.read_bytes())
    header = 8 + struct.unpack("<Q", data[:8])[0]
    at = header + (len(data) - header) // 2
    data[at] ^= 0xFF
    victim.write_bytes(bytes(data))
    advice = (
        f"; nothing committed; repair {src} (`fsdpkit verify {src}` names what is damaged), then run the same command again "
        f"with --restart (a repaired source counts as another conversion: the parts finished in {staging_path(dst)} are written again)"
    )
    for _ in range(2):
        corrupt = _convert(src, dst, "--nproc-per-node", "1")
        assert corrupt.exit_code == 3 and len(_error_lines(corrupt)) == 1, corrupt.output
        assert "checksum mismatch" in corrupt.output and _error_lines(corrupt)[0].endswith(advice), corrupt.output
    data[at] ^= 0xFF
    victim.write_bytes(bytes(data))
    same = _convert(src, dst, "--nproc-per-node", "1")
    assert same.exit_code == 2 and "holds the partial output of another conversion" in same.output, same.output
    restarted = _convert(src, dst, "--nproc-per-node", "1", "--restart")
    assert restarted.exit_code == 0 and _files(dst) == _files(clean), restarted.output


def test_a_rank_that_fails_stops_every_rank_and_commits_nothing(source, tmp_path):
    root, _, _ = source
    dst = tmp_path / "out"
    result = _convert(root / "run", dst, "--nproc-per-node", "2", env={FAULT_ENV: "full:1:2:convert"})
    assert result.exit_code == 1, result.output
    lines = [line for line in result.output.splitlines() if line.startswith("error:")]
    assert len(lines) == 1 and "rank 1" in lines[0] and ".safetensors" in lines[0] and "No space left" in lines[0], result.output
    assert not dst.exists() and staging_path(dst).exists()
    restart = _convert(root / "run", dst, "--nproc-per-node", "1", "--restart")
    assert restart.exit_code == 0, restart.output
    assert json.loads(restart.stdout)["spread"]["kept_parts"] == 0 and not staging_path(dst).exists()


def test_a_killed_rank_then_the_same_command_continues(source, tmp_path):
    root, _, clean = source
    dst = tmp_path / "out"
    total = sum(p.stat().st_size for p in clean.glob("*.safetensors"))
    parts = len(list(clean.glob("*.safetensors")))
    killed = _convert(root / "run", dst, "--nproc-per-node", "2", env={FAULT_ENV: f"kill:1:{parts // 4 + 1}:convert"})
    assert killed.exit_code == 1, killed.output
    line = [line for line in killed.output.splitlines() if line.startswith("error:")]
    assert len(line) == 1 and "rank 1" in line[0] and "while writing " in line[0] and "nothing committed" in line[0], killed.output
    assert not dst.exists()
    recorded = len(_records(staging_path(dst)))
    rerun = _convert(root / "run", dst, "--nproc-per-node", "2")
    assert rerun.exit_code == 0, rerun.output
    assert _files(dst) == _files(clean)
    spread = json.loads(rerun.stdout)["spread"]
    assert f"{recorded} of {sum(r['parts'] for r in spread['ranks'])} parts are kept in {staging_path(dst)}" in line[0], line
    assert spread["kept_parts"] == recorded >= parts // 4 and sum(r["kept"] for r in spread["ranks"]) == recorded
    assert spread["bytes_read"] <= 0.55 * total


def test_a_part_whose_fsync_fails_is_named_and_the_parts_recorded_before_it_are_kept(source, tmp_path, monkeypatch):
    """A part's fsync (made with its record while the next part is written) failing as a full
    disk's delayed allocation does: one line naming that part's file, nothing committed; the same
    command again keeps the parts recorded before it and writes the one-process bytes."""
    root, _, clean = source
    dst = tmp_path / "out"
    failed, third = _interrupted_at_the_third_file(source, dst, monkeypatch)
    assert failed.exit_code == 1, failed.output
    lines = [line for line in failed.output.splitlines() if line.startswith("error:")]
    assert len(lines) == 1 and third in lines[0] and "No space left" in lines[0] and "nothing committed" in lines[0], failed.output
    assert not dst.exists()
    rerun = _convert(root / "run", dst, "--nproc-per-node", "1")
    assert rerun.exit_code == 0, rerun.output
    assert json.loads(rerun.stdout)["spread"]["kept_parts"] >= 2
    assert _files(dst) == _files(clean)


def _interrupted_at_the_third_file(source, dst: Path, monkeypatch) -> tuple[Any, str]:
    """A one-process spread convert to `dst` whose third output file's record fails as a full
    disk's delayed allocation does (its fsync): (the result, that file's name)."""
    from fsdpkit.checkpoint.spread.staging import Staging

    root, _, clean = source
    record, third = Staging.record, sorted(p.name for p in clean.glob("*.safetensors"))[2]

    def record_but_the_third(staging, result):
        if result.name == third:
            raise OSError(28, "No space left on device")
        record(staging, result)

    monkeypatch.setattr(Staging, "record", record_but_the_third)
    try:
        return _convert(root / "run", dst, "--nproc-per-node", "1"), third
    finally:
        monkeypatch.setattr(Staging, "record", record)


def _error_lines(result) -> list[str]:
    return [line for line in result.output.splitlines() if line.startswith("error:")]


def test_a_dry_run_refuses_what_the_run_refuses_and_writes_nothing(source, tmp_path, monkeypatch):
    """An existing DST, a staging area of another conversion, a disk without room: the dry run's
    line and exit code are the run's, and it leaves what is there as it was."""
    from collections import namedtuple

    from fsdpkit.checkpoint.core import staging as core_staging

    root, _, clean = source
    usage = namedtuple("usage", "total used free")
    with monkeypatch.context() as patched:
        patched.setattr(core_staging.shutil, "disk_usage", lambda path: usage(10**9, 10**9 - 100, 100))
        dry = _convert(root / "run", tmp_path / "full", "--nproc-per-node", "2", "--dry-run")
        real = _convert(root / "run", tmp_path / "full", "--nproc-per-node", "1")
    assert dry.exit_code == real.exit_code == 1 and _error_lines(dry) == _error_lines(real), (dry.output, real.output)
    assert "not enough disk space" in _error_lines(dry)[0] and not list(tmp_path.iterdir())
    other = tmp_path / "y"
    staging_path(other).mkdir()
    (staging_path(other) / "model.safetensors").write_bytes(b"partial")
    before = tree_snapshot(clean), tree_snapshot(staging_path(other))
    for dst, says in ((clean, "already exists; pass --overwrite"), (other, "holds the partial output of another conversion")):
        dry = _convert(root / "run", dst, "--nproc-per-node", "2", "--dry-run")
        real = _convert(root / "run", dst, "--nproc-per-node", "1")
        assert dry.exit_code == real.exit_code == 2, (dry.output, real.output)
        assert len(_error_lines(dry)) == 1 and says in _error_lines(dry)[0] and _error_lines(dry) == _error_lines(real), dry.output
    assert (tree_snapshot(clean), tree_snapshot(staging_path(other))) == before and not other.exists()


def _records(staging: Path) -> list[dict]:
    """The parts an interrupted run recorded as written, read from its staging area."""
    done = [json.loads(p.read_text()) for p in sorted((staging / ".fsdpkit-spread" / "done").glob("*.json"))]
    return [record for record in done if (staging / record["name"]).is_file()]


def test_a_dry_run_says_what_the_rerun_keeps_and_a_plain_command_continues_it(source, tmp_path, monkeypatch):
    """After an interrupted spread run: the dry run says which finished parts the rerun keeps (the
    records in the staging area; the count the rerun reports), with --restart what it would
    discard, and writes nothing; the disk needs room only for what the staging area does not hold
    yet; the same DST given other options is another conversion (refused). The plain command (no
    launch flag) continues the staging area (a note says so) instead of leaving it beside DST.
    Another conversion's staging area is refused by the plain command as by a spread run, and
    --restart discards it."""
    from collections import namedtuple

    from fsdpkit.checkpoint.core import staging as core_staging

    root, _, clean = source
    dst = tmp_path / "out"
    assert _interrupted_at_the_third_file(source, dst, monkeypatch)[0].exit_code == 1
    staging = staging_path(dst)
    records, before = _records(staging), tree_snapshot(staging)
    kept_bytes = sum(r["end"] - r["begin"] for r in records)
    assert len(records) >= 2
    output = sum(p.stat().st_size for p in clean.glob("*.safetensors"))
    staged = sum(p.stat().st_size for p in staging.iterdir() if p.is_file())
    room = namedtuple("usage", "total used free")(10**12, 0, int(output * 1.01 - staged / 2))  # room for the rest, not for all
    with monkeypatch.context() as patched:
        patched.setattr(core_staging.shutil, "disk_usage", lambda path: room)
        dry = _convert(root / "run", dst, "--nproc-per-node", "1", "--dry-run")
    assert dry.exit_code == 0, dry.output
    dry = json.loads(dry.stdout)
    assert (dry["staging"], dry["kept_parts"], dry["kept_bytes"], dry["discarded_parts"]) == (str(staging), len(records), kept_bytes, 0)
    other_options = _convert(root / "run", dst, "--dtype", "bf16", "--nproc-per-node", "2", "--dry-run")
    assert other_options.exit_code == 2 and "holds the partial output of another conversion" in other_options.output, other_options.output
    text = run_cli("convert", root / "run", dst, "--to", "full", "--max-shard-size", SHARD, "--with-optimizer", "--dry-run")
    assert f"kept: {len(records)} of " in text.stdout, text.stdout
    restart = json.loads(_convert(root / "run", dst, "--nproc-per-node", "1", "--dry-run", "--restart").stdout)
    assert (restart["kept_parts"], restart["discarded_parts"], restart["discarded_bytes"]) == (0, len(records), kept_bytes)
    assert tree_snapshot(staging) == before and not dst.exists()  # the dry runs wrote nothing
    plain = _convert(root / "run", dst)
    assert plain.exit_code == 0 and f"{staging} holds the partial output of an interrupted spread run" in plain.output, plain.output
    assert json.loads(plain.stdout)["spread"]["kept_parts"] == len(records)
    assert _files(dst) == _files(clean) and not staging.exists()
    other = tmp_path / "y"
    staging_path(other).mkdir()
    refused = _convert(root / "run", other)
    assert refused.exit_code == 2 and "another conversion" in refused.output and staging_path(other).exists(), refused.output
    restarted = _convert(root / "run", other, "--restart")
    assert restarted.exit_code == 0 and _files(other) == _files(clean) and not staging_path(other).exists(), restarted.output


def test_the_plain_command_given_other_options_says_only_that_the_staging_area_is_another_conversions(source, tmp_path, monkeypatch):
    """After an interrupted spread run, the plain command with another --dtype: one line, the
    refusal, and no note that it continues the staging area; the area stays as it was."""
    root, _, _ = source
    dst = tmp_path / "out"
    assert _interrupted_at_the_third_file(source, dst, monkeypatch)[0].exit_code == 1
    before = tree_snapshot(staging_path(dst))
    other = _convert(root / "run", dst, "--dtype", "bf16")
    lines = [line for line in other.output.splitlines() if line.strip()]
    assert other.exit_code == 2 and len(lines) == 1, other.output
    assert lines[0].startswith(f"error: {staging_path(dst)} holds the partial output of another conversion"), other.output
    assert tree_snapshot(staging_path(dst)) == before and not dst.exists()


def _locked_elsewhere(path: Path) -> bool:
    """Whether another open file description holds an flock on directory `path`."""
    import fcntl

    fd = os.open(path, os.O_RDONLY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    finally:
        os.close(fd)
    return False


def test_a_second_command_on_the_same_dst_is_refused_while_the_first_runs(source, tmp_path, monkeypatch):
    """A run holds its staging area from its start to its commit; while it does, the same
    command, with --restart, its dry run and the plain command are refused with one line, and
    what the staging area holds stays; once it has gone, the same command continues."""
    import fcntl

    from fsdpkit.checkpoint.spread.staging import Staging

    root, _, clean = source
    dst = tmp_path / "out"
    assert _interrupted_at_the_third_file(source, dst, monkeypatch)[0].exit_code == 1
    staging = staging_path(dst)
    before = tree_snapshot(staging)
    fd = os.open(staging, os.O_RDONLY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        for flags in (("--nproc-per-node", "2"), ("--nproc-per-node", "2", "--restart"), ("--nproc-per-node", "1", "--dry-run"), ()):
            refused = _convert(root / "run", dst, *flags)
            assert refused.exit_code == 2, refused.output
            line = f"error: destination {dst} is being written by another fsdpkit command (it holds {staging}): wait for it to finish"
            assert _error_lines(refused) == [f"{line}; nothing written"], refused.output
        assert tree_snapshot(staging) == before and not dst.exists()
    finally:
        os.close(fd)
    record, seen = Staging.record, []

    def record_and_look(self, result):
        seen.append(_locked_elsewhere(staging))
        record(self, result)

    monkeypatch.setattr(Staging, "record", record_and_look)
    rerun = _convert(root / "run", dst, "--nproc-per-node", "1")
    assert rerun.exit_code == 0 and json.loads(rerun.stdout)["spread"]["kept_parts"] >= 2, rerun.output
    assert seen and all(seen) and _files(dst) == _files(clean)


def _recorded_bar(monkeypatch) -> list[tuple[int, int]]:
    """Every (bytes done, total) shown on rank 0's bar from now on, whichever way the run makes
    it (the command line's, for one process; the launching rank's, for several)."""
    from fsdpkit import progress
    from fsdpkit.checkpoint.spread import runner

    shown: list[tuple[int, int]] = []
    for module in (progress, runner):
        monkeypatch.setattr(module, "stderr_progress", lambda desc: (lambda done, total: shown.append((done, total)), lambda: None))
    return shown


def test_a_rerun_counts_its_progress_against_the_source_bytes_it_reads(source, tmp_path, monkeypatch):
    """After an interrupted run the bar's total is, within 1 %, the source bytes the rerun reads
    (not those of the parts it keeps), and its count is every byte it reads."""
    root, _, _ = source
    dst = tmp_path / "out"
    assert _interrupted_at_the_third_file(source, dst, monkeypatch)[0].exit_code == 1
    shown = _recorded_bar(monkeypatch)
    rerun = _convert(root / "run", dst, "--nproc-per-node", "1")
    assert rerun.exit_code == 0, rerun.output
    spread = json.loads(rerun.stdout)["spread"]
    read = spread["bytes_read"]
    totals = {total for _, total in shown}
    assert len(totals) == 1 and shown[0][0] == 0, shown[:3]
    assert spread["kept_parts"] >= 2 and totals.pop() == pytest.approx(read, rel=0.01)
    assert sum(done for done, _ in shown) == read


def test_rank_0s_bar_ends_at_every_ranks_bytes_read(source, tmp_path, monkeypatch):
    """Two processes: the bar rank 0 shows counts rank 1's bytes too, up to the last of them,
    however early rank 0's own parts are done."""
    root, _, _ = source
    shown = _recorded_bar(monkeypatch)
    result = _convert(root / "run", tmp_path / "out", "--nproc-per-node", "2")
    assert result.exit_code == 0, result.output
    ranks = json.loads(result.stdout)["spread"]["ranks"]
    assert all(rank["bytes_read"] > 0 for rank in ranks) and sum(done for done, _ in shown) == sum(rank["bytes_read"] for rank in ranks)


def test_the_dry_run_predicts_the_time_of_the_bytes_left_to_read(source, tmp_path, monkeypatch):
    """After an interrupted run, at a read rate fixed at 1000 bytes a second: the dry run predicts
    the time to read what the rerun writes (the parts kept are not read again); with --restart,
    everything."""
    from fsdpkit.checkpoint.spread import dryrun

    root, _, _ = source
    dst = tmp_path / "out"
    assert _interrupted_at_the_third_file(source, dst, monkeypatch)[0].exit_code == 1
    monkeypatch.setattr(dryrun, "read_bandwidth", lambda src: (1000.0, "a rate fixed by the test"))
    resumed = json.loads(_convert(root / "run", dst, "--nproc-per-node", "1", "--dry-run").stdout)
    restart = json.loads(_convert(root / "run", dst, "--nproc-per-node", "1", "--dry-run", "--restart").stdout)
    assert resumed["kept_bytes"] > 0 and resumed["predicted_seconds"] == pytest.approx((resumed["bytes"] - resumed["kept_bytes"]) / 1000)
    assert restart["predicted_seconds"] == pytest.approx(restart["bytes"] / 1000) and restart["bytes"] == resumed["bytes"]


def test_a_rerun_with_another_process_count_keeps_only_the_parts_cut_the_same_way():
    """Records of a run of 2 processes, read by a run of 3: the whole files are kept; the file cut
    into other byte ranges is written again (its records name other ranges under the same indices)."""
    from fsdpkit.checkpoint.spread.plan import OutputFile, make_plan
    from fsdpkit.checkpoint.spread.staging import PartResult, kept_parts

    files = [OutputFile("a", 100), OutputFile("b", 4000, cuts=((0, 4000, 10),)), OutputFile("c", 300)]
    two, three = make_plan(files, 2), make_plan(files, 3)
    assert len(two.parts_of_file(1)) > 1 and two.parts_of_file(1) != three.parts_of_file(1)
    records = {(p.file, p.index): PartResult(p.file, p.index, files[p.file].name, p.begin, p.end) for p in two.parts}
    assert set(kept_parts(three, records)) == {(0, 0), (2, 0)}
    assert set(kept_parts(two, records)) == set(records)


def test_a_node_that_never_joins_is_named_with_what_is_kept(source, tmp_path):
    """Node 0 of 2 alone, with a worker: once --timeout passes, its one line names the first rank
    that never joined (not its own worker, whose wait for that rank fails at the same moment and
    which then exits), what the staging area keeps and that the same command continues it."""
    import socket

    root, _, _ = source
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    dst = tmp_path / "y"
    nodes = ("--nproc-per-node", "2", "--nnodes", "2", "--node-rank", "0", "--master-addr", "127.0.0.1", "--master-port", port)
    alone = run_cli("convert", root / "run", dst, "--to", "full", "--max-shard-size", SHARD, *nodes, "--timeout", "2")
    assert alone.exit_code == 1, alone.output
    lines = _error_lines(alone)
    assert len(lines) == 1 and lines[0].startswith("error: rank 2 did not join within --timeout 2 s; nothing committed; "), alone.output
    kept = len(_records(staging_path(dst)))
    assert re.search(rf"; {kept} of \d+ parts are kept in {re.escape(str(staging_path(dst)))}: run the same command again", lines[0]), lines
    assert not dst.exists()


def test_a_rank_that_hangs_is_named_once_the_timeout_passes(source, tmp_path):
    root, _, _ = source
    dst = tmp_path / "out"
    hung = _convert(root / "run", dst, "--nproc-per-node", "2", "--timeout", "6", env={FAULT_ENV: "stop:1:2:convert"})
    assert hung.exit_code == 1, hung.output
    line = [line for line in hung.output.splitlines() if line.startswith("error:")]
    assert len(line) == 1 and "rank 1 stopped while writing " in line[0] and "nothing committed" in line[0], hung.output
    assert not dst.exists()


def test_bad_input_is_one_line_and_writes_nothing(source, tmp_path, no_launch):
    """Found by rank 0 before any rank writes; on one node the workers, started first so that
    they open the source while rank 0 plans, then leave (torch's launcher is never started)."""
    root, _, clean = source
    wrong = run_cli("convert", root / "run", tmp_path / "x", "--to", "sharded", "--world-size", "2", "--nproc-per-node", "2")
    assert wrong.exit_code == 2 and "cannot be converted --to sharded" in wrong.output
    unknown = run_cli("convert", root / "run", tmp_path / "x", "--to", "onnx", "--nproc-per-node", "2")
    assert unknown.exit_code == 2 and "unknown --to 'onnx'" in unknown.output
    there = run_cli("convert", root / "run", clean, "--to", "full", "--nproc-per-node", "2")
    assert there.exit_code == 2 and "already exists" in there.output
    staging = staging_path(tmp_path / "y")
    staging.mkdir()
    other = run_cli("convert", root / "run", tmp_path / "y", "--to", "full", "--nproc-per-node", "2")
    assert other.exit_code == 2 and "--restart" in other.output and staging.exists()
    shutil.rmtree(staging)
    assert not (tmp_path / "x").exists() and not (tmp_path / "y").exists()


def test_without_nproc_per_node_each_node_runs_one_process(source):
    """torchrun's default, on one node and on several alike, as the help says (train's differs)."""
    root, _, _ = source
    nodes = {"1": (), "2": ("--node-rank", "0", "--master-addr", "127.0.0.1", "--master-port", "29500")}
    for nnodes, flags in nodes.items():
        planned = run_cli("verify", root / "run", "--nnodes", nnodes, *flags, "--dry-run", "--json")
        assert planned.exit_code == 0 and json.loads(planned.stdout)["world_size"] == int(nnodes), planned.output
    ran = run_cli("verify", root / "run", "--nnodes", "1")
    assert ran.exit_code == 0 and "spread over 1 rank: " in ran.output, ran.output
    shown = run_cli("verify", "--help")
    assert "default 1 on each node, as torchrun's" in " ".join(shown.output.replace("│", " ").split()), shown.output


def test_two_nodes_on_loopback_and_torchrun_write_the_same_bytes(source, tmp_path):
    """Two nodes of two processes each (fsdpkit's --nnodes, --node-rank, --master-addr,
    --master-port: rank 0's hub over TCP, no torch in any rank, each node's worker started before
    the CLI is imported) and, at the same time, `torchrun -m fsdpkit_cli convert` with two
    processes (a gloo group), and one node's `--nproc-per-node 2` (its worker started early too),
    with good input and with bad."""
    import socket
    import subprocess
    import sys

    root, _, clean = source
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    common = ["convert", str(root / "run"), "--to", "full", "--max-shard-size", SHARD, "--with-optimizer", "--json"]
    nodes = [
        [sys.executable, "-m", "fsdpkit_cli", *common[:2], str(tmp_path / "nodes"), *common[2:], "--nproc-per-node", "2", "--nnodes", "2"]
        + ["--node-rank", str(rank), "--master-addr", "127.0.0.1", "--master-port", str(port)]
        for rank in (0, 1)
    ]
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", "-m", "fsdpkit_cli"]
    torchrun += [*common[:2], str(tmp_path / "torchrun"), *common[2:]]
    early = [sys.executable, "-m", "fsdpkit_cli", *common[:2], str(tmp_path / "early"), *common[2:], "--nproc-per-node", "2"]
    bad = [*early[:5], str(tmp_path / "bad"), "--to", "nothing", "--nproc-per-node", "2"]
    runs = [*nodes, torchrun, early, bad]
    started = [subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for args in runs]
    outputs = [process.communicate(timeout=240) for process in started]
    assert [process.returncode for process in started] == [0, 0, 0, 0, 2], outputs
    assert outputs[4][1].startswith("error: unknown --to 'nothing'") and len(outputs[4][1].splitlines()) == 1, outputs[4]
    assert not (tmp_path / "bad").exists()
    assert _files(tmp_path / "early") == _files(clean)
    assert outputs[1][0] == ""  # node 0's rank 0 reports; node 1 says nothing
    assert _files(tmp_path / "nodes") == _files(clean)
    assert _files(tmp_path / "torchrun") == _files(clean)
    ranks = json.loads(outputs[0][0])["spread"]["ranks"]
    assert [r["rank"] for r in ranks] == [0, 1, 2, 3] and not any(r["torch"] for r in ranks)  # node 1's ranks 2, 3 too
    assert all(0 < r["peak_rss_bytes"] <= 300 * 2**20 and r["cpu_seconds"] > 0 and r["run_delay_seconds"] >= 0 for r in ranks), ranks
    assert all(0 < r["main_thread_cpu_seconds"] <= r["cpu_seconds"] + 0.01 for r in ranks), ranks  # both rounded to ms
    steps = ["begun", "opened", "planned", "working", "worked"]  # each on its node's own clock
    assert [sorted(r["marks"], key=r["marks"].get) for r in ranks] == [[*steps, "gathered", "committed"], *[steps] * 3], ranks
    under_torchrun = json.loads(outputs[2][0])["spread"]["ranks"]
    assert all(r["torch"] and r["peak_rss_bytes"] > 0 for r in under_torchrun), under_torchrun


def test_nodes_that_spell_the_master_address_differently_join_one_run(source):
    """Node 0 given --master-addr localhost, node 1 127.0.0.1 (the same host), and no
    --nproc-per-node: one run of 2 ranks, whose verify is the one-process verify's."""
    import socket
    import subprocess
    import sys

    root, _, _ = source
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    nodes = [
        [sys.executable, "-m", "fsdpkit_cli", "verify", str(root / "run"), "--nnodes", "2", "--node-rank", str(rank)]
        + ["--master-addr", address, "--master-port", str(port), "--timeout", "30"]
        for rank, address in ((0, "localhost"), (1, "127.0.0.1"))
    ]
    started = [subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for args in nodes]
    outputs = [process.communicate(timeout=120) for process in started]
    assert [process.returncode for process in started] == [0, 0], outputs
    one = run_cli("verify", root / "run")
    assert one.exit_code == 0 and outputs[0][0] == one.stdout and outputs[1][0] == "", (one.output, outputs)
    assert "spread over 2 ranks" in outputs[0][1], outputs


def test_a_rank_killed_on_the_second_node_stops_both_nodes_and_commits_nothing(source, tmp_path):
    """Rank 3, a worker on node 1, SIGKILLed as it starts its 2nd part: its connection to rank 0
    closes; both nodes' commands stop with one line naming rank 3 (not the ranks still at work)
    and the part, and DST is not there. Node 0 counts the parts the staging area keeps (every
    record there); node 1, which cannot know when every rank has stopped, says where they are."""
    import socket
    import subprocess
    import sys

    root, _, _ = source
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    dst = tmp_path / "out"
    flags = ["--to", "full", "--max-shard-size", SHARD, "--nproc-per-node", "2", "--nnodes", "2", "--master-addr", "127.0.0.1"]
    env = {**os.environ, FAULT_ENV: "kill:3:2:convert"}
    nodes = [
        [
            sys.executable,
            "-m",
            "fsdpkit_cli",
            "convert",
            str(root / "run"),
            str(dst),
            *flags,
            "--master-port",
            str(port),
            "--node-rank",
            str(rank),
        ]
        for rank in (0, 1)
    ]
    started = [subprocess.Popen(args, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for args in nodes]
    outputs = [process.communicate(timeout=120) for process in started]
    assert [process.returncode for process in started] == [1, 1], outputs
    lines = []
    for _, err in outputs:
        found = [line for line in err.splitlines() if line.startswith("error:")]
        assert len(found) == 1 and found[0].startswith("error: rank 3 stopped while writing model-"), err
        assert "nothing committed" in found[0] and "rank 1" not in found[0] and "rank 2" not in found[0], err
        lines += found
    assert not dst.exists() and staging_path(dst).exists()
    kept = f"; {len(_records(staging_path(dst)))} of "
    assert kept in lines[0] and re.search(r"; \d+ of \d+ parts", lines[1]) is None, (kept, lines)
    assert lines[1].endswith(
        f"; the parts finished are kept in {staging_path(dst)}: run the same command again to continue (--restart starts over)"
    )


def test_a_node_refused_for_running_another_command_claims_no_parts_kept(source, tmp_path):
    """Node 1 started with another --max-shard-size once node 0 has planned its run: rank 0
    refuses its key, and node 1's one line says so and nothing of the parts node 0's staging
    area keeps (they are of a conversion node 1 is not running); node 0 names the rank that never
    joined once its --timeout passes."""
    import socket
    import subprocess
    import sys
    import time

    root, _, _ = source
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    dst = tmp_path / "out"
    command = [sys.executable, "-m", "fsdpkit_cli", "convert", str(root / "run"), str(dst), "--to", "full", "--nnodes", "2"]
    command += ["--master-addr", "127.0.0.1", "--master-port", str(port), "--timeout", "4", "--node-rank"]
    node0 = subprocess.Popen([*command, "0", "--max-shard-size", SHARD], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    planned = staging_path(dst) / ".fsdpkit-spread" / "plan-rank0.json"
    deadline = time.monotonic() + 60
    while not planned.exists() and node0.poll() is None and time.monotonic() < deadline:
        time.sleep(0.05)
    node1 = subprocess.run([*command, "1", "--max-shard-size", "100KB"], capture_output=True, text=True, timeout=60)
    _, err0 = node0.communicate(timeout=60)
    assert node1.returncode == 1 and node1.stdout == "", node1
    assert re.fullmatch(
        r"error: rank 1: rank 0 at 127\.0\.0\.1:\d+ refused this node's key: every node must run the same command[^\n]*\n", node1.stderr
    )
    assert "kept" not in node1.stderr and "continue" not in node1.stderr, node1.stderr
    lines = [line for line in err0.splitlines() if line.startswith("error:")]
    assert node0.returncode == 1 and len(lines) == 1 and lines[0].startswith("error: rank 1 did not join within --timeout 4 s"), err0
    assert f"; {len(_records(staging_path(dst)))} of " in lines[0], lines


def test_a_node_rank_given_twice_is_named_even_when_the_run_is_quick(tmp_path):
    """Two commands given --node-rank 1, then node 0's, of a run over as soon as
    one of them joined: the other still hears that its rank joined twice, in one line (not that
    rank 0 did not answer: rank 0 answers joins a while after its run)."""
    import socket
    import subprocess
    import sys
    import time

    save_checkpoint(tmp_path / "run", 1, {"w": torch.arange(8, dtype=torch.float32)}, world_size=2)
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    flags = ["--nproc-per-node", "1", "--nnodes", "2", "--master-addr", "127.0.0.1", "--master-port", str(port), "--timeout", "5"]
    verify = [sys.executable, "-m", "fsdpkit_cli", "verify", str(tmp_path / "run"), *flags, "--node-rank"]
    twins = [subprocess.Popen([*verify, "1"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for _ in range(2)]
    time.sleep(0.5)  # both trying to join when node 0's rank 0 begins to listen
    started = [subprocess.Popen([*verify, "0"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True), *twins]
    outputs = [process.communicate(timeout=60) for process in started]
    assert started[0].returncode == 0 and sorted(process.returncode for process in started[1:]) == [0, 1], outputs
    twice = next(err for process, (_, err) in zip(started, outputs, strict=True) if process.returncode == 1)
    assert twice == "error: rank 1 joined twice or is outside 1..1: give each node its own --node-rank\n", outputs


class _Job:
    """What `view_problem` asks of a job: the facts its fingerprint is made of."""

    def facts(self):
        return {"source": [["rank-00000-of-00001.safetensors", 100, 1]]}


def _staging_area_holding(tmp_path: Path, token: str) -> tuple[Any, dict]:
    """A convert to tmp_path/out whose staging area holds `token`, and rank 0's header (its token: token-of-rank-0)."""
    from fsdpkit.checkpoint.spread.runner import SpreadTask
    from fsdpkit.checkpoint.spread.staging import STATE_DIR, TOKEN_NAME, fingerprint

    staging = tmp_path / ".tmp-out-resumable"
    (staging / STATE_DIR).mkdir(parents=True)
    (staging / STATE_DIR / TOKEN_NAME).write_text(f"{token}\n")
    header = {"digest": fingerprint(_Job().facts()), "staging": str(staging), "token": "token-of-rank-0"}
    return SpreadTask("convert", "SRC", str(tmp_path / "out")), header


def test_a_node_that_does_not_see_the_same_paths_is_named(source, tmp_path, monkeypatch):
    """What each rank checks before writing: its listing of SRC matches rank 0's, and it reads
    the token rank 0 wrote into DST's staging area (on a node without the shared filesystem it
    cannot); a run whose rank does not read it stops with that line before any part is written."""
    from fsdpkit.checkpoint.spread import runner
    from fsdpkit.checkpoint.spread.runner import view_problem

    task, header = _staging_area_holding(tmp_path, "token-of-rank-0")
    assert view_problem(task, _Job(), header, 3) is None
    elsewhere = view_problem(task, _Job(), {**header, "staging": str(tmp_path / "not-on-this-node")}, 3)
    assert elsewhere is not None and "rank 3" in elsewhere and "every node must see the same DST" in elsewhere
    other_source = view_problem(task, _Job(), {**header, "digest": "0" * 32}, 2)
    assert other_source is not None and "rank 2" in other_source and "sees SRC differently" in other_source
    monkeypatch.setattr(runner, "_seen_token", lambda location: None)  # as on a node that does not share DST's filesystem
    blind = _convert(source[0] / "run", tmp_path / "blind", "--nproc-per-node", "1")
    assert blind.exit_code == 1 and len(_error_lines(blind)) == 1, blind.output
    assert "rank 0 on " in blind.output and "every node must see the same DST" in blind.output, blind.output
    assert not (tmp_path / "blind").exists() and _records(staging_path(tmp_path / "blind")) == []


def test_a_node_that_sees_a_staging_area_of_another_run_at_dst_is_named(tmp_path):
    """A node whose DST is not rank 0's but holds a staging area of the same name, left there by
    another run: it reads a token, not the one rank 0 wrote, and is named."""
    from fsdpkit.checkpoint.spread.runner import view_problem

    task, header = _staging_area_holding(tmp_path, "token-of-another-run")
    stale = view_problem(task, _Job(), header, 1)
    assert stale is not None and "rank 1" in stale and "every node must see the same DST" in stale, stale
    assert view_problem(task, _Job(), {**header, "token": "token-of-another-run"}, 1) is None


def test_a_node_where_src_does_not_exist_is_named_and_nothing_is_committed(source, tmp_path):
    """Two nodes on loopback given SRC as a relative path, each started in another directory: node
    1 finds no SRC where it runs. Both nodes stop with that rank's own line (its host, SRC, why),
    nothing is committed, and what rank 0 finished meanwhile is kept for the rerun."""
    import socket
    import subprocess
    import sys

    root = source[0]
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    command = [sys.executable, "-m", "fsdpkit_cli", "convert", "run", str(tmp_path / "out"), "--to", "full", "--nnodes", "2"]
    command += ["--master-addr", "127.0.0.1", "--master-port", str(port), "--timeout", "60"]
    started = [
        subprocess.Popen([*command, "--node-rank", str(rank)], cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        for rank, cwd in ((0, root), (1, elsewhere))
    ]
    outputs = [process.communicate(timeout=120) for process in started]
    assert started[0].returncode not in (0, None) and started[1].returncode not in (0, None), outputs
    for out, err in outputs:
        lines = err.strip().splitlines()
        assert out == "" and len(lines) == 1 and lines[0].startswith(f"error: rank 1 on {socket.gethostname()}: run: does not exist"), err
        assert "nothing committed" in lines[0] and "run the same command again to continue" in lines[0], err
    assert not (tmp_path / "out").exists() and staging_path(tmp_path / "out").is_dir()


def test_which_command_lines_start_their_workers_first(monkeypatch):
    from fsdpkit.checkpoint.spread.processes import early_nproc

    monkeypatch.delenv("TORCHELASTIC_RUN_ID", raising=False)
    assert early_nproc(["convert", "a", "b", "--nproc-per-node", "4"]) == 4
    assert early_nproc(["verify", "a", "--nproc_per_node=2", "--json"]) == 2
    assert early_nproc(["convert", "a", "b", "--nproc-per-node", "1"]) is None  # runs in this process
    assert early_nproc(["convert", "a", "b", "--nproc-per-node", "cpu"]) is None
    assert early_nproc(["convert", "a", "b", "--nproc-per-node", "64"]) == 64
    assert early_nproc(["convert", "a", "b", "--nproc-per-node", "65"]) is None  # more than a launch allows: refused, none started
    assert early_nproc(["convert", "a", "b", "--nproc-per-node", "2", "--dry-run"]) is None
    assert early_nproc(["convert", "a", "b", "--nproc-per-node", "2", "--nnodes", "2", "--node-rank", "1"]) == 2  # this node's
    assert early_nproc(["train", "--nproc-per-node", "2"]) is None
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "x")
    assert early_nproc(["convert", "a", "b", "--nproc-per-node", "2"]) is None


def test_the_workers_started_early_join_as_this_nodes_ranks(monkeypatch):
    """Node 2 of 3, 3 processes each: the command line's two early workers are the processes that
    join rank 0 as ranks 7 and 8 of 9, with the key, rank and world size given on their stdin."""
    import threading
    from multiprocessing.connection import Client, Listener

    from fsdpkit.checkpoint.spread.processes import start_early, start_workers, stop_workers

    monkeypatch.delenv("TORCHELASTIC_RUN_ID", raising=False)
    early = start_early(["convert", "a", "b", "--nproc-per-node", "3", "--nnodes", "3", "--node-rank", "2", "--master-port", "1"])
    assert early is not None and sorted(early.processes) == [1, 2]
    started = set(early.processes.values())
    key, joined = b"k" * 32, []
    with Listener(("127.0.0.1", 0), authkey=key) as hub:
        processes = start_workers(hub.address, key, range(7, 9), 9, 60.0, early)
        stand_ins = threading.Timer(120, lambda: [Client(hub.address, authkey=key).send(("join", None, 0)) for _ in processes])
        stand_ins.start()  # workers that never join fail the test instead of hanging it
        for _ in processes:
            with hub.accept() as conn:
                joined.append(conn.recv())
                conn.send(("error", "no run here"))
        stand_ins.cancel()
    stop_workers(processes, grace=60)
    assert sorted(processes) == [7, 8] and set(processes.values()) == started and early.processes == {}
    assert sorted(joined) == [("join", 7, 9), ("join", 8, 9)]
    assert [process.returncode for process in processes.values()] == [1, 1]  # the hub's refusal: a RunError


def test_a_worker_outlives_neither_its_launching_process_nor_its_handshake():
    """Two workers whose rank 0 took their connections and never answers: with a timeout of 60 s,
    each exits with its own line once the process that started them is killed (none is left
    orphaned); with a timeout of 1 s, each says its handshake did not finish and exits 1."""
    import signal
    import subprocess
    import sys
    import time

    launcher = (
        "import socket, sys, time\n"
        "from fsdpkit.checkpoint.spread.processes import start_workers\n"
        "mute = socket.create_server(('127.0.0.1', 0))\n"  # listens, never accepts
        "processes = start_workers(mute.getsockname(), b'k' * 32, range(1, 3), 3, float(sys.argv[1]))\n"
        "print(*(p.pid for p in processes.values()), flush=True)\n"
        "print(*(p.wait(20) for p in processes.values()), flush=True)\n"
    )
    started = subprocess.Popen([sys.executable, "-c", launcher, "60"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    assert started.stdout is not None and started.stderr is not None
    workers = [int(pid) for pid in started.stdout.readline().split()]
    os.kill(started.pid, signal.SIGKILL)
    started.wait()
    deadline = time.monotonic() + 10
    while any(_running(pid) for pid in workers) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not any(_running(pid) for pid in workers), workers
    lines = sorted(started.stderr.read().splitlines())  # the workers' stderr: the launcher's, inherited
    assert lines == [f"error: rank {rank}: the process that started it (pid {started.pid}) has gone; it stops" for rank in (1, 2)]

    timed_out = subprocess.run([sys.executable, "-c", launcher, "1"], capture_output=True, text=True, timeout=30)
    assert timed_out.stdout.splitlines()[1] == "1 1", timed_out
    lines = sorted(re.sub(r":\d+ ", ":PORT ", line) for line in timed_out.stderr.splitlines())
    assert lines == [
        f"error: rank {rank}: rank 0 at 127.0.0.1:PORT took the connection but did not finish the handshake within --timeout 1 s"
        for rank in (1, 2)
    ]


def _running(pid: int) -> bool:
    """Whether process `pid` exists and has not exited (a zombie has)."""
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rpartition(")")[2].split()[0] != "Z"
    except FileNotFoundError:
        return False
