"""The plan of a spread conversion: every output byte to exactly one rank, balanced by bytes,
files cut only where their format allows (pure arithmetic, no process group)."""

from __future__ import annotations

import itertools
import random

import pytest

from fsdpkit.checkpoint.spread.plan import OutputFile, Plan, make_plan


def _covered_once(plan: Plan) -> None:
    """Every file's parts tile [0, nbytes) in order, each owned by one valid rank."""
    for index, file in enumerate(plan.files):
        parts = plan.parts_of_file(index)
        assert [p.index for p in parts] == list(range(len(parts)))
        assert parts[0].begin == 0 and parts[-1].end == file.nbytes
        assert all(a.end == b.begin for a, b in itertools.pairwise(parts))
    assert all(0 <= owner < plan.world_size for owner in plan.owners)
    assert sum(plan.rank_bytes()) == sum(f.nbytes for f in plan.files)


def _hundred_files(seed: int, *, cuts: bool) -> list[OutputFile]:
    rng = random.Random(seed)
    files = []
    for i in range(100):
        size = int(rng.lognormvariate(20, 0.6)) // 4 * 4 + 4096  # ~0.5 GB, spread over 4x either way
        files.append(OutputFile(f"model-{i + 1:05d}-of-00100.safetensors", size, ((4096, size, 4),) if cuts else ()))
    return files


@pytest.mark.parametrize("world_size", [2, 8, 16])
def test_a_hundred_whole_files_are_within_a_tenth_of_the_mean(world_size):
    plan = make_plan(_hundred_files(0, cuts=False), world_size)
    _covered_once(plan)
    assert len(plan.parts) == 100  # whole files: none was cut
    mean = plan.total_bytes / world_size
    assert max(plan.rank_bytes()) <= 1.1 * mean
    assert plan.imbalance == pytest.approx(max(plan.rank_bytes()) / mean)


def test_more_ranks_than_files_cut_the_files_that_allow_it():
    files = _hundred_files(1, cuts=True)
    plan = make_plan(files, 256)
    _covered_once(plan)
    assert plan.imbalance <= 1.1
    for part in plan.parts:  # every cut on an allowed offset: a multiple of 4 after the 4096-byte header
        assert part.begin == 0 or (part.begin >= 4096 and (part.begin - 4096) % 4 == 0)
    whole = make_plan(_hundred_files(1, cuts=False), 256)
    assert whole.imbalance > 2  # 100 files on 256 ranks: the largest file alone is several shares
    assert not whole.notes  # no reason given: nothing to say


def test_a_single_file_that_cannot_be_split_is_named_in_the_plan():
    why = "a single-file safetensors output is written by one process"
    plan = make_plan([OutputFile("model.safetensors", 1000, (), why)], 4)
    _covered_once(plan)
    assert plan.rank_bytes() == [1000, 0, 0, 0]
    assert len(plan.notes) == 1 and "model.safetensors" in plan.notes[0] and why in plan.notes[0]
    assert make_plan([OutputFile("model.safetensors", 1000, (), why)], 1).notes == ()


def test_greedy_is_within_four_thirds_of_the_best_assignment():
    """Against every assignment of 9 files to 3 ranks (the optimum, found by brute force)."""
    rng = random.Random(2)
    for _ in range(5):
        sizes = [rng.randint(1, 100) for _ in range(9)]
        best = min(
            max(sum(s for s, r in zip(sizes, owners, strict=True) if r == rank) for rank in range(3))
            for owners in itertools.product(range(3), repeat=9)
        )
        plan = make_plan([OutputFile(f"f{i}", s) for i, s in enumerate(sizes)], 3)
        _covered_once(plan)
        assert max(plan.rank_bytes()) <= best * 4 / 3


def test_cuts_fall_on_allowed_offsets_only():
    # a header of 100 bytes, a tensor of 8-byte elements, one that may not be cut inside (transposed), another of 2-byte ones
    file = OutputFile("f", 100 + 800 + 400 + 200, ((100, 900, 8), (900, 1300, 400), (1300, 1500, 2)))
    assert file.nearest_cut(5) == 100
    assert file.nearest_cut(103) == 100 and file.nearest_cut(105) == 108
    assert file.nearest_cut(1000) == 900 and file.nearest_cut(1200) == 1300
    assert file.nearest_cut(1401) in (1400, 1402)
    plan = make_plan([file, OutputFile("g", 10)], 4)
    _covered_once(plan)
    allowed = {0, *range(100, 901, 8), 1300, *range(1300, 1501, 2)}
    assert all(p.begin in allowed for p in plan.parts if p.file == 0)


def test_the_plan_survives_its_json_and_is_the_same_every_time():
    files = _hundred_files(3, cuts=True)
    plan = make_plan(files, 64)
    again = Plan.from_json(plan.to_json())
    assert (again.parts, again.owners, again.notes, again.rank_bytes()) == (plan.parts, plan.owners, plan.notes, plan.rank_bytes())
    assert make_plan(files, 64) == plan
    with pytest.raises(ValueError, match="world size"):
        make_plan(files, 0)


def test_the_formats_whose_verify_spreads_are_those_with_a_verify_job():
    """dispatch names them without importing the verify jobs (a run imports only the job it runs)."""
    from fsdpkit.checkpoint.offline.formats import SHARDED
    from fsdpkit.checkpoint.spread.dispatch import spreads
    from fsdpkit.checkpoint.spread.verify_jobs import VERIFY_JOBS

    assert {name for name in (*VERIFY_JOBS, SHARDED, "nothing") if spreads("verify", name)} == {*VERIFY_JOBS, SHARDED}
