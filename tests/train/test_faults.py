"""Faults in a 2-process training run, through the real CLI: a killed worker with
--max-restarts 1 (the run completes bitwise equal to an uninterrupted one), a stopped or
missing rank (one line naming the rank, the collective and the step, within --timeout + 30 s),
SIGTERM (a checkpoint, exit 0, resumable bitwise), SIGINT (exit 130, no process left) and the
run directory's lock.

Faults are placed with the test hook FSDPKIT_TEST_FAULT (fsdpkit/dist/faults.py) so they happen at
known steps; a "stopped" worker is SIGSTOPped by the hook and then killed or continued from
here, as an operator would. Every run is gpt-tiny, 8 steps of 4 x 32 tokens, saved every 2.
Cost: about 15 launches (the restarted runs count twice) and two 10 s timeouts.
"""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from support.processes import children, leaked_semaphores, semaphores, workers

from fsdpkit.checkpoint.live.tensors import CheckpointReader
from fsdpkit.train.attempts import History

FSDPKIT = str(Path(sys.executable).with_name("fsdpkit"))
STEPS = 8
COMMON = ["--seq-len", "32", "--global-batch-size", "4", "--save-every", "2", "--quiet"]
TIMEOUT = 10  # --timeout of the hang tests: short, with room for slow worker starts on a busy machine


@dataclass
class Run:
    directory: Path
    exit_code: int
    summary: dict | None
    stderr: str

    @property
    def run_dir(self) -> Path:
        return self.directory / "run"


def start(directory: Path, *args: str, fault: str | None = None) -> subprocess.Popen:
    directory.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    env.pop("FSDPKIT_TEST_FAULT", None)
    if fault:
        env["FSDPKIT_TEST_FAULT"] = fault
    return subprocess.Popen(
        [FSDPKIT, "train", "--steps", str(STEPS), *COMMON, "--save-dir", "run", "--json", *args],
        cwd=directory,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        start_new_session=True,
    )


def finish(process: subprocess.Popen, directory: Path, timeout: float = 300) -> Run:
    out, err = process.communicate(timeout=timeout)
    summary = json.loads(out) if process.returncode == 0 else None
    return Run(directory, process.returncode, summary, err.decode())


def train(directory: Path, *args: str, fault: str | None = None) -> Run:
    return finish(start(directory, *args, fault=fault), directory)


def weights(path: Path) -> dict[str, torch.Tensor]:
    with CheckpointReader(path) as reader:
        return {name: reader.read_tensor(name) for name in reader.tensor_names()}


def assert_bitwise_equal(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert a.keys() == b.keys()
    assert all(torch.equal(a[name], b[name]) for name in a), [n for n in a if not torch.equal(a[n], b[n])]


def stopped_worker(process: subprocess.Popen, deadline: float = 240) -> int:
    """Wait for a worker of `process` to be stopped (SIGSTOP); its pid."""
    end = time.monotonic() + deadline
    while time.monotonic() < end:
        assert process.poll() is None, process.communicate()
        for pid in workers(process.pid):
            try:
                if Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "T":
                    return pid
            except OSError:
                continue
        time.sleep(0.1)
    raise AssertionError("no worker stopped")


def wait_for_pending(pid: int, signum: int, deadline: float = 60) -> None:
    """Wait until signal `signum` is pending for the (stopped) process `pid`."""
    bit, end = 1 << (signum - 1), time.monotonic() + deadline
    while time.monotonic() < end:
        status = dict(line.split(":", 1) for line in Path(f"/proc/{pid}/status").read_text().splitlines() if ":" in line)
        if any(int(status[key], 16) & bit for key in ("SigPnd", "ShdPnd")):
            return
        time.sleep(0.05)
    raise AssertionError(f"signal {signum} never reached process {pid}")


def left_in_session(session: int, wait: float = 10) -> list[str]:
    """Live (not zombie) processes of a session, after waiting up to `wait` s for them to go."""
    end = time.monotonic() + wait
    while True:
        alive = []
        for stat in Path("/proc").glob("[0-9]*/stat"):
            try:
                fields = stat.read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(fields[3]) == session and fields[0] != "Z":
                alive.append(stat.parent.name)
        if not alive or time.monotonic() > end:
            return alive
        time.sleep(0.2)


def one_error_line(run: Run) -> str:
    lines = run.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), run.stderr
    return lines[0]


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> Run:
    """An uninterrupted run, started over a stale lock (a dead process of this host held it)."""
    directory = tmp_path_factory.mktemp("reference")
    (directory / "run").mkdir()
    (directory / "run" / ".lock").write_text(
        json.dumps({"host": socket.gethostname(), "pid": 2**22 + 12345, "started": "1", "run": "crashed-run"})
    )
    run = train(directory)
    assert run.exit_code == 0, run.stderr
    return run


def test_a_stale_lock_is_taken_over_with_a_message(reference):
    assert reference.stderr.strip() == (
        f"warning: took over the lock of run from pid {2**22 + 12345} on "
        f"{socket.gethostname()} (run crashed-run), which is no longer running"
    )
    assert reference.summary["restarts"] == 0 and reference.summary["steps_redone"] == 0
    assert not reference.summary["preempted"] and len(reference.summary["losses"]) == STEPS
    assert not (reference.run_dir / ".lock").exists()


def test_the_summary_reports_the_time_saves_held_up_training(reference):
    """Saved every 2 of 8 steps, synchronously: the saves between steps held up the training
    thread. (The stall is the largest over ranks and the timings are rank 0's, so the two are not
    compared: a slower rank 1 makes the stall exceed rank 0's total.)"""
    summary = reference.summary
    timings = summary["save_timings"]  # rank 0's
    assert timings["saves"] == STEPS // 2 and summary["save_stall_s"] > 0
    parts = timings["snapshot"] + timings["checksum"] + timings["write"] + timings["fsync"]
    assert min(timings.values()) >= 0 and parts <= timings["total"]


def test_tokens_per_second_counts_the_saves_and_step_tokens_per_second_does_not(reference):
    """The same run: the steps' own time (`step_tokens_per_second`: every step but the first) and
    the save stall fit in the wall time; counting the saves, `tokens_per_second` is the lower."""
    summary = reference.summary
    tokens_per_step = 4 * 32
    step_seconds = tokens_per_step * (STEPS - 1) / summary["step_tokens_per_second"]  # every step but the first
    assert step_seconds + summary["save_stall_s"] < summary["elapsed_seconds"]
    assert summary["step_tokens_per_second"] > summary["tokens_per_second"]
    assert summary["save_stall_s"] > 0 and summary["snapshot_stall_s"] == 0  # saves, no snapshots (no --max-restarts)


def test_a_locked_directory_is_refused_before_launching(tmp_path):
    from fsdpkit.checkpoint.format.lock import RunLock

    with RunLock.acquire(tmp_path / "run") as lock:
        done = subprocess.run(
            [FSDPKIT, "train", "--save-dir", str(tmp_path / "run"), "--steps", "1"],
            capture_output=True,
            text=True,
            env={**os.environ, "OMP_NUM_THREADS": "1"},
        )
        assert done.returncode == 2 and done.stdout == ""
        assert done.stderr.splitlines() == [
            f"error: {tmp_path / 'run'} is in use by another run: pid {os.getpid()} on {socket.gethostname()} "
            f"(run {lock.run_id}) holds {tmp_path / 'run' / '.lock'}; wait for it to finish, or remove the lock file "
            f"if that run is gone"
        ]
    assert sorted(p.name for p in (tmp_path / "run").iterdir()) == []


@pytest.fixture(scope="module")
def preempted(tmp_path_factory) -> Run:
    """SIGTERM to the launcher while rank 1 is stopped after step 3 and rank 0 waits for it in
    step 4; rank 1 then continues: both finish step 4, save it, and exit 0."""
    directory = tmp_path_factory.mktemp("preempted")
    process = start(directory, "--steps", "100", fault="stop:1:3")
    worker = stopped_worker(process)
    os.kill(process.pid, signal.SIGTERM)
    wait_for_pending(worker, signal.SIGTERM)  # the launcher passes it on; rank 1 gets it while stopped
    os.kill(worker, signal.SIGCONT)
    return finish(process, directory)


def test_sigterm_finishes_the_step_saves_and_exits_0(preempted, reference):
    assert preempted.exit_code == 0, preempted.stderr
    summary = preempted.summary
    assert summary["preempted"] is True and summary["steps"] == 4 and summary["checkpoint"] == "run/step-00000004"
    assert summary["losses"] == reference.summary["losses"][:4]
    assert_bitwise_equal(weights(preempted.run_dir / "step-00000004"), weights(reference.run_dir / "step-00000004"))
    assert sorted(p.name for p in preempted.run_dir.iterdir()) == ["latest", "step-00000002", "step-00000004"]


# Each: the fault, extra flags, the steps run again, what the run directory holds at the end.
KILLS = {
    "before any checkpoint": ("kill:1:1", [], 1, None),
    "between checkpoints": ("kill:0:3", ["--metrics", "metrics.jsonl"], 1, None),
    "during a save": ("kill:1:4:save", [], 2, None),
    "during an async save, resumed from a preempted run": (
        "kill:0:6:save",
        ["--async-save", "--keep-last", "2", "--resume", "{preempted}"],
        None,
        ["latest", "step-00000006", "step-00000008"],
    ),
    "stopped, then killed from outside": ("stop:1:5", [], 1, None),
}


@pytest.mark.parametrize("case", list(KILLS))
def test_a_killed_worker_is_restarted_and_the_run_ends_bitwise_equal(case, reference, preempted, tmp_path):
    fault, flags, redone, listing = KILLS[case]
    flags = [f.format(preempted=preempted.run_dir) for f in flags]
    process = start(tmp_path, "--max-restarts", "1", *flags, fault=fault)
    if fault.startswith("stop"):
        os.kill(stopped_worker(process), signal.SIGKILL)
    run = finish(process, tmp_path)
    assert run.exit_code == 0, run.stderr
    summary = reference.summary
    resumed = "--resume" in flags
    assert run.summary["losses"] == summary["losses"][4 if resumed else 0 :]
    assert run.summary["resumed_from_step"] == (4 if resumed else None)
    assert run.summary["restarts"] == 1 and run.summary["steps"] == STEPS and run.summary["save_stall_s"] >= 0
    if redone is None:
        assert run.summary["steps_redone"] >= 1  # where the main thread was when the writer thread died varies
    else:
        assert run.summary["steps_redone"] == redone
    assert_bitwise_equal(weights(run.run_dir), weights(reference.run_dir))
    names = sorted(p.name for p in run.run_dir.iterdir())
    assert names == (listing or ["latest", "step-00000002", "step-00000004", "step-00000006", "step-00000008"])
    if "--metrics" in flags:  # the steps run again appear once
        records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
        assert [r["step"] for r in records] == list(range(1, STEPS + 1))
        assert [r["loss"] for r in records] == summary["losses"]


LINE = re.compile(r"error: rank 0 timed out after 10 s in (\w+) \(([^)]*)\) at step (\d+): rank 1 did not take part")


def test_a_stopped_worker_fails_the_run_within_the_timeout_naming_rank_collective_and_step(tmp_path):
    process = start(tmp_path, "--timeout", str(TIMEOUT), fault="stop:1:3")
    stopped_worker(process)
    run = finish(process, tmp_path, timeout=TIMEOUT + 30)  # bound: --timeout plus 30 s
    assert run.exit_code == 1
    kind, label, step = LINE.fullmatch(one_error_line(run)).groups()
    assert (kind, label, step) == ("all_gather", "unit <root>", "4")  # the first collective of step 4
    assert left_in_session(process.pid) == []
    assert not (run.run_dir / ".lock").exists()
    assert not [p for p in run.run_dir.iterdir() if p.name.startswith(".tmp")]


def test_a_rank_that_skips_a_collective_fails_the_run_naming_it(tmp_path):
    # one unit per block (the default bucket would merge gpt-tiny's blocks): the line names h.1
    run = train(tmp_path, "--timeout", str(TIMEOUT), "--bucket-bytes", "0", fault="skip:1:4:reduce_scatter")
    assert run.exit_code == 1
    assert one_error_line(run) == ("error: rank 0 timed out after 10 s in reduce_scatter (unit h.1) at step 4: rank 1 did not take part")


def test_sigint_exits_130_and_leaves_no_process(tmp_path):
    process = start(tmp_path, "--steps", "100", fault="stop:1:3")
    stopped_worker(process)  # a stopped worker too: it must not outlive the run
    os.killpg(process.pid, signal.SIGINT)  # what Ctrl-C sends: the launcher and its workers
    run = finish(process, tmp_path, timeout=60)
    assert run.exit_code == 130 and run.stderr == "error: interrupted\n" and run.summary is None
    assert left_in_session(process.pid) == []
    assert not (run.run_dir / ".lock").exists()


def test_history_of_attempts_counts_the_steps_run_again():
    records = [
        {"attempt": 0, "start": 2, "metrics_offset": 10},
        *({"attempt": 0, "step": s, "loss": float(s), "metrics_offset": 10 * s} for s in (3, 4, 5)),
        {"attempt": 1, "start": 4, "metrics_offset": 40},
        *({"attempt": 1, "step": s, "loss": float(s), "metrics_offset": 10 * s} for s in (5, 6, 7)),
        {"attempt": 1, "step": 8, "loss": 8.0},  # a line cut short by the kill is never parsed
    ]
    history = History.of(records)
    assert history.first_step == 2
    assert history.steps_redone(6) == (5 - 4) + (8 - 6)
    assert list(history.steps_before(6)) == [3, 4, 5, 6]
    assert history.metrics_offsets[6] == 60 and history.metrics_offsets[2] == 10
    assert History.of([]).steps_redone(0) == 0 and list(History.of([]).steps_before(0)) == []


# Twenty moments from the console script's start-up to steps and saves well into training, each
# interrupted once, alternately to the process group (a terminal's Ctrl-C) and to the launcher
# alone (`timeout -s INT`). Ten runs at a time: they load the machine as a busy host would, which
# is where the races lie (a worker still importing torch, one exiting, torch's own import). The
# first is late enough for Python itself to have started the console script on a busy machine.
SIGINT_WAVES = ((0.5, 0.8, 1.1, 1.4, 1.8, 2.2, 2.7, 3.2, 3.8, 4.5), (5.0, 6.0, 7.0, 8.5, 10.0, 12.0, 14.0, 17.0, 20.0, 24.0))


def test_an_interrupt_python_cannot_raise_is_delivered_again():
    """A KeyboardInterrupt raised where Python can only report it (a `__del__`, a weakref callback
    of the import machinery) comes again through the timer under the CLI's hook, with no report;
    any other exception is still reported. Without the hook the interrupt is lost."""
    code = (
        "import signal, sys, time\n"
        "from fsdpkit_cli.entry import Interrupts\n"
        "interrupts = Interrupts()\n"
        "signal.signal(signal.SIGALRM, interrupts)  # as the CLI does\n"
        "if sys.argv[1] == 'hook':\n"
        "    sys.unraisablehook = interrupts.unraisable_hook\n"
        "class Interrupted:\n"
        "    def __del__(self): raise KeyboardInterrupt\n"
        "class Failing:\n"
        "    def __del__(self): raise ValueError('reported')\n"
        "try:\n"
        "    Failing(); Interrupted()\n"
        "    for _ in range(500): time.sleep(0.001)\n"
        "    print('not interrupted')\n"
        "except KeyboardInterrupt:\n"
        "    print('interrupted')\n"
    )
    hooked, plain = (subprocess.run([sys.executable, "-c", code, mode], capture_output=True, text=True) for mode in ("hook", "plain"))
    assert hooked.stdout == "interrupted\n" and "ValueError: reported" in hooked.stderr, (hooked.stdout, hooked.stderr)
    assert "KeyboardInterrupt" not in hooked.stderr, hooked.stderr
    assert plain.stdout == "not interrupted\n" and "KeyboardInterrupt" in plain.stderr, (plain.stdout, plain.stderr)


def test_an_interrupt_held_back_during_torchs_import_does_not_come_again_in_the_exit():
    """Ctrl-C while torch is imported arms the retry timer; a second one just after the import is
    raised at once. The timer then fires during the exit (here an exit made slow on purpose): it
    must neither raise a second KeyboardInterrupt (a traceback) nor, once Python has put SIGALRM's
    default action back, kill the process (exit 142)."""
    result = _entry_running(
        "torch_spec = types.SimpleNamespace(_initializing=True)\n"
        "def run(early=None):\n"
        "    sys.modules['torch'] = types.SimpleNamespace(__spec__=torch_spec)  # torch being imported\n"
        "    os.kill(os.getpid(), signal.SIGINT)  # held back: the timer looks again shortly after\n"
        "    time.sleep(0.005)\n"
        "    torch_spec._initializing = False\n"
        "    os.kill(os.getpid(), signal.SIGINT)  # raised at once\n"
        "    time.sleep(5)\n"
        "atexit.register(time.sleep, 1.0)  # the timer fires meanwhile\n"
    )
    assert (result.returncode, result.stderr) == (130, "error: interrupted\n")


def test_an_interrupt_that_python_wrapped_in_another_error_is_one_line_and_exit_130():
    """Ctrl-C while an import defines a dataclass: Python 3.11 wraps the KeyboardInterrupt raised
    in a field's `__set_name__` in a RuntimeError, which must end as every interrupt does."""
    result = _entry_running(
        "class Field:\n"
        "    def __set_name__(self, owner, name):\n"
        "        os.kill(os.getpid(), signal.SIGINT)\n"
        "def run(early=None):\n"
        "    type('LogsDest', (), {'filtered_stdout': Field()})\n"
    )
    assert (result.returncode, result.stderr) == (130, "error: interrupted\n")


def _entry_running(setup: str) -> subprocess.CompletedProcess:
    """The console script's `entry.main()` in a fresh interpreter, its command line replaced by the
    `run` that `setup` (Python source) defines, without Typer."""
    code = (
        "import atexit, os, signal, sys, time, types\n"
        "from fsdpkit_cli import entry\n"
        f"{setup}"
        "sys.modules['fsdpkit_cli.app'] = types.SimpleNamespace(main=run)\n"
        "entry.main()\n"
    )
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)


def test_sigint_at_any_moment_is_one_line_and_exit_130(tmp_path):
    """SIGINT while the CLI imports, parses, validates, starts the workers, trains or saves: one
    line and exit 130, no process left (an interrupt that code below torch's imports swallowed
    included: it is noted in the environment, and the launcher checks before it starts workers)."""
    from fsdpkit_cli.entry import INTERRUPTED_ENV as noted

    from fsdpkit.dist.launch import INTERRUPTED_ENV

    assert noted == INTERRUPTED_ENV
    failures = []
    for wave in SIGINT_WAVES:
        started = time.monotonic()
        runs = [(delay, index % 2 == 0, start(tmp_path / f"{delay}", "--steps", "100000")) for index, delay in enumerate(wave)]
        for delay, to_group, process in runs:
            time.sleep(max(0.0, started + delay - time.monotonic()))
            (os.killpg if to_group else os.kill)(process.pid, signal.SIGINT)
        for delay, to_group, process in runs:
            run = finish(process, tmp_path, timeout=120)
            lines = [line for line in run.stderr.splitlines() if not line.startswith(("launching ", "training: "))]  # progress lines
            if (run.exit_code, lines) != (130, ["error: interrupted"]) or left_in_session(process.pid):
                failures.append((delay, "group" if to_group else "launcher", run.exit_code, run.stderr[-2000:]))
    assert failures == []


# Ctrl-C pressed three times, 0.1 s apart, to the process group, at twelve moments of the start-up,
# each counted from what the launcher is doing, so that a busy machine moves the moments with it:
# from when torch's import has begun (the library is mapped; an interrupt during the import is held
# back and raised when it ends) and from when the launch has begun (its first child process).
SIGINT_BURSTS = (
    *(("torch", offset) for offset in (0.1, 0.3, 0.6, 0.9, 1.3, 1.8)),
    *(("launch", offset) for offset in (0.0, 0.2, 0.5, 0.8, 1.2, 2.0)),
)
SIGINTS_PER_BURST, BURST_GAP_SECONDS = 3, 0.1


def _begun(pid: int, stage: str) -> bool:
    if stage == "launch":
        return bool(children(pid))
    try:
        return "libtorch_cpu" in Path(f"/proc/{pid}/maps").read_text()
    except OSError:
        return False


def test_sigint_pressed_three_times_at_any_moment_is_one_line_and_exit_130(tmp_path):
    """A burst of Ctrl-C while torch is imported, as the import ends, as the workers start: one
    line and exit 130 every time, never a traceback or a death by the retry timer's SIGALRM (142),
    and no named semaphore left in /dev/shm (one the launcher was making as an interrupt came)."""
    before = semaphores()
    runs = [(stage, offset, start(tmp_path / f"{stage}-{offset}", "--steps", "100000")) for stage, offset in SIGINT_BURSTS]
    moments: dict[int, list[float]] = {}  # run -> when its SIGINTs are due
    deadline = time.monotonic() + 240
    while len(moments) < len(runs) or any(moments.values()):
        assert time.monotonic() < deadline, "the launches did not reach their stages"
        now = time.monotonic()
        for index, (stage, offset, process) in enumerate(runs):
            if index not in moments and (process.poll() is not None or _begun(process.pid, stage)):
                moments[index] = [now + offset + k * BURST_GAP_SECONDS for k in range(SIGINTS_PER_BURST)]
            due = moments.get(index, [])
            while due and due[0] <= now:
                due.pop(0)
                if process.poll() is None:
                    os.killpg(process.pid, signal.SIGINT)
        time.sleep(0.01)
    failures = []
    for stage, offset, process in runs:
        run = finish(process, tmp_path, timeout=120)
        lines = [line for line in run.stderr.splitlines() if not line.startswith(("launching ", "training: "))]  # progress lines
        if (run.exit_code, lines) != (130, ["error: interrupted"]) or left_in_session(process.pid):
            failures.append((stage, offset, run.exit_code, run.stderr[-2000:]))
    assert failures == []
    assert leaked_semaphores(before) == []
