"""Fixtures shared by the whole suite. Helpers that worker processes import (the distributed
launcher, the reference models and loop, checkpoint files written by hand) live in the
`support` package, importable from spawned workers; `tests/` is on the path (pyproject's
`pythonpath`)."""

from __future__ import annotations

import shutil

import pytest

# The files that take longest (a minute or more of launches each), run first: under `make test`
# (`-n 2 --dist loadfile`, files handed out in collection order) the last files are then short
# ones, and neither worker waits long for the other at the end.
LONGEST_FIRST = (
    "tests/train/",
    "tests/checkpoint/test_megatron",
    "tests/plan/test_plan_time.py",
    "tests/engine/test_compile.py",
    "tests/checkpoint/test_deepspeed.py",
)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    def turn(item: pytest.Item) -> int:
        return next((index for index, prefix in enumerate(LONGEST_FIRST) if item.nodeid.startswith(prefix)), len(LONGEST_FIRST))

    items.sort(key=turn)  # stable: each file's tests keep their order


@pytest.fixture
def no_launch(monkeypatch):
    """Fail the test if a command launches workers: bad input must be rejected before that."""
    from fsdpkit.bench import runner as bench_runner
    from fsdpkit.train import launcher

    def launch(*_args, **_kwargs):
        raise AssertionError("bad input must be rejected before launching")

    monkeypatch.setattr(launcher, "launch", launch)
    monkeypatch.setattr(bench_runner, "launch", launch)


@pytest.fixture(scope="session", autouse=True)
def temporary_files_in_basetemp(tmp_path_factory):
    """torch.compile's code and the temporary files of the commands the tests start (TMPDIR: a
    launcher killed before it could remove its workers' files) under pytest's base directory,
    removed with it, not in /tmp; workers and commands inherit both."""
    basetemp = tmp_path_factory.getbasetemp()
    (basetemp / "tmp").mkdir(exist_ok=True)
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("TORCHINDUCTOR_CACHE_DIR", str(basetemp / "inductor"))
        patch.setenv("TMPDIR", str(basetemp / "tmp"))
        yield


@pytest.fixture(scope="module", autouse=True)
def module_tmp_removed(request, tmp_path_factory):
    """The directories a test file made under pytest's base directory (its module fixtures'
    runs and checkpoints, up to gigabytes), removed when the file's tests end, unless one failed."""
    basetemp = tmp_path_factory.getbasetemp()
    before, failed = set(basetemp.iterdir()), request.session.testsfailed
    yield
    if request.session.testsfailed == failed:
        for path in set(basetemp.iterdir()) - before:
            shutil.rmtree(path, ignore_errors=True)


@pytest.fixture(scope="session")
def s3_endpoint():
    """A moto S3 server in this process for the whole session (the cloud and test extras)."""
    from support.object_store import moto_server

    with moto_server() as endpoint:
        yield endpoint


@pytest.fixture
def s3_bucket(s3_endpoint, monkeypatch, request):
    """A new, empty bucket on the test server, and the environment that reaches it; no other
    AWS setting (a profile, a session token) leaks in from the machine."""
    import os
    import re

    from support.object_store import s3_client, s3_environment

    for name in [name for name in os.environ if name.startswith("AWS_")]:
        monkeypatch.delenv(name)
    for name, value in s3_environment(s3_endpoint).items():
        monkeypatch.setenv(name, value)
    bucket = re.sub(r"[^a-z0-9]+", "-", request.node.name.lower())[:50].strip("-") + "-bkt"
    s3_client(s3_endpoint).create_bucket(Bucket=bucket)
    return bucket
