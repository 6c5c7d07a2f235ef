"""The spread run: one plan, every rank its share, rank 0's commit (docs/distributed-conversion.md).

    rank 0   opens the source, plans, prepares the staging area (a token in it) -> broadcast
    every    opens the source (or, on rank 0's node, takes what rank 0 opened where the job allows it),
             checks it derives the same output and sees the token -> all_gather
    every    writes (or checks) its parts, records each one, skips those recorded before
    every    -> all_gather of failures, checksums, figures; any failure: all stop, nothing committed
    rank 0   checks every source checksum read in parts, writes the manifest/index, renames to DST
             (to a bucket, `bucket`: each rank uploaded its whole files; rank 0 uploads the commit object last)

Only these small objects pass between ranks; the bytes go from the source files to the output
files in each rank. They pass through a gloo group under torchrun, and with fsdpkit's own flags,
on one node or several, through rank 0's hub (`hub`, `processes`: the launching process of node
0 is rank 0, no rank needs torch). One process (world size 1) runs the same steps without either.
"""

from __future__ import annotations

import json
import re
import resource
import socket
import sys
import time
from contextlib import ExitStack
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ... import log
from ...dist import faults
from ...dist.host import peak_rss_bytes, run_delay_seconds, thread_cpu_seconds
from ...dist.launch import LaunchOptions, under_torchrun
from ...errors import DataCheckError, FsdpkitError, RunError, UsageError
from ...progress import ByteProgress, stderr_progress
from ...sizes import count as count_of
from ..core.bytecopy import DEFAULT_CHUNK_SIZE
from ..core.request import ConvertRequest
from ..storage.location import is_url
from .bucket import BucketStaging, bucket_plan, check_bucket, prepare_bucket, staging_at
from .dispatch import handed_job_class, job_class, open_job
from .hub import CONNECT_RETRY_SECONDS, Hub, HubClient, RankGone, shared_key
from .plan import Part, Plan, make_plan
from .processes import EarlyWorkers, start_workers, stop_workers
from .progress import SharedCount
from .staging import PartRecorder, PartResult, Staging, check_staging, fingerprint, kept_parts, prepare, staging_path
from .torchrun_group import Group, StoreGone

if TYPE_CHECKING:
    from ..offline.diff import DiffRequest

PLAN_FILE = "plan-rank0.json"
WORKERS_EXIT_SECONDS = 5.0  # after a run that succeeded, a worker still there is killed after this
LATE_JOIN_SECONDS = 2 * CONNECT_RETRY_SECONDS  # across nodes, rank 0 answers joins this long after its run


@dataclass(frozen=True)
class SpreadTask:
    """What a spread command was asked: the command, its source and destination, its options."""

    command: str  # "convert", "reshard", "verify" or "diff"
    src: str
    dst: str | None = None
    request: ConvertRequest | DiffRequest | None = None  # convert's or diff's
    world_size: int | None = None  # reshard's
    chunk_size: int = DEFAULT_CHUNK_SIZE
    overwrite: bool = False
    restart: bool = False
    timeout: float = 300.0
    resumes: bool = field(default=False, repr=False)  # a command without launch flags, spread to continue DST's staging area

    @property
    def writes(self) -> bool:
        return self.command in ("convert", "reshard")

    @property
    def to_bucket(self) -> bool:
        """It writes to an object-store URL (every rank uploads its own files)."""
        return self.writes and self.dst is not None and is_url(self.dst)


@dataclass
class RankFigures:
    rank: int
    host: str
    parts: int = 0  # parts planned for this rank
    kept: int = 0  # of them, recorded by an earlier run and not written again
    bytes_planned: int = 0
    bytes_read: int = 0  # source bytes read in this run
    seconds: float = 0.0
    peak_rss_bytes: int = 0  # this process's peak resident memory, once its parts were written
    torch: bool = False  # whether this process imported torch
    opened_source: bool = True  # False: it took what rank 0 opened (a rank of rank 0's node)
    cpu_seconds: float = 0.0  # this process's (user and system), from its start until its parts were done
    main_thread_cpu_seconds: float = 0.0  # of it, the main thread's (the rest: its threads that write back and record parts, the hub's)
    run_delay_seconds: float = 0.0  # its main thread's waits for a core, from its start until its parts were done
    marks: dict[str, float] = field(default_factory=dict)  # time.monotonic() as each step ended (Marks)


@dataclass
class SpreadResult:
    report: Any  # the writer's report (a dict), or verify's VerifyReport
    plan: Plan
    ranks: list[RankFigures]
    kept_parts: int
    bytes_read: int
    staging: str | None = None
    details: dict = field(default_factory=dict)


class Solo:
    """The coordination of a run of one process."""

    rank, world_size, store = 0, 1, None

    def broadcast(self, value: Any) -> Any:
        return value

    def all_gather(self, value: Any) -> list[Any]:
        return [value]


class Marks(dict):
    """When each step of a rank ended, on its node's monotonic clock (one for all the node's processes):
    begun (this rank's run began), opened (its source), planned (rank 0 planned; a worker got the
    plan), working (its first part began), worked (its last part ended), gathered (every rank's
    report came), committed (rank 0)."""

    def mark(self, step: str) -> None:
        self[step] = time.monotonic()


def open_task_job(task: SpreadTask):
    return open_job(task.command, task.src, request=task.request, world_size=task.world_size, chunk_size=task.chunk_size)


def _lead(task: SpreadTask, comm: Any, marks: Marks, held: ExitStack) -> tuple[dict, Any, Staging | BucketStaging | None]:
    """Rank 0's first step: the header every rank gets (or the error every rank raises), with
    what it opened for the ranks of its node to take (`handed`), where the job allows it; the
    job; and the staging area it prepared, whose lock (a bucket's lease) is held until the
    commit or until `held` closes."""
    job, staging = None, None
    try:
        job = open_task_job(task)
        marks.mark("opened")
        plan = task_plan(task, job, comm.world_size)
        digest = fingerprint(job.facts())
        header: dict[str, Any] = {"error": None, "plan": plan.to_json(), "digest": digest, "staging": None, "token": None, "kept": []}
        header["handed"] = job.hand_on() if getattr(comm, "hands_job", False) and hasattr(job, "hand_on") else None
        if task.writes:
            staging = _prepare(task, job, digest, plan, held)
            if task.resumes:  # said once the staging area is found to be this conversion's
                log.note(
                    f"{staging.where} holds the partial output of an interrupted spread run to {task.dst}: "
                    "running as --nproc-per-node 1, which continues it (--restart discards it)"
                )
            staging.write_state(PLAN_FILE, json.dumps(plan.to_json()))
            kept = [asdict(result) for result in kept_parts(plan, staging.records()).values()]  # read before any rank records a part
            header.update(staging=task.dst if task.to_bucket else staging.where, token=staging.token(), kept=kept)
        marks.mark("planned")
        return header, job, staging
    except FsdpkitError as error:
        if job is not None:
            job.close()
        from .jobs import OneProcessOnly  # a job module: on this error path only

        if isinstance(error, OneProcessOnly):  # every rank raises it again: under torchrun rank 0 then runs it alone
            return {"error": ("OneProcessOnly", error.why)}, None, None
        kind = "UsageError" if isinstance(error, UsageError) else type(error).__name__
        return {"error": (kind, str(error))}, None, None


def task_plan(task: SpreadTask, job: Any, world_size: int) -> Plan:
    """The plan of `task`: whole files only when it writes to a bucket."""
    return bucket_plan(job.files, world_size) if task.to_bucket else make_plan(job.files, world_size)


def _prepare(task: SpreadTask, job: Any, digest: str, plan: Plan, held: ExitStack) -> Staging | BucketStaging:
    """Rank 0: the staging area of DST, made or found again, locked (a bucket's: leased) until the
    commit or until `held` closes."""
    assert task.dst is not None
    if task.to_bucket:
        return prepare_bucket(task.dst, digest=digest, overwrite=task.overwrite, restart=task.restart, held=held)
    return prepare(Path(task.dst), held=held, **_local_staging(task, job, digest, plan))[0]


def checked_staging(task: SpreadTask, job: Any, digest: str, plan: Plan) -> Staging | BucketStaging:
    """Every check `_prepare` makes, writing nothing (`--dry-run`): the staging area of DST, there or not."""
    assert task.dst is not None
    if task.to_bucket:
        return check_bucket(task.dst, digest=digest, overwrite=task.overwrite, restart=task.restart)
    return check_staging(Path(task.dst), **_local_staging(task, job, digest, plan))


def _local_staging(task: SpreadTask, job: Any, digest: str, plan: Plan) -> dict[str, Any]:
    src = Path(getattr(getattr(job, "opened", None), "opened_from", task.src))
    return {"src": src, "digest": digest, "overwrite": task.overwrite, "restart": task.restart, "needed_bytes": plan.total_bytes}


def _raise(kind: str, message: str) -> None:
    if kind == "OneProcessOnly":
        from .jobs import OneProcessOnly

        raise OneProcessOnly(message)
    raise {"UsageError": UsageError, "DataCheckError": DataCheckError}.get(kind, RunError)(message)


def view_problem(task: SpreadTask, job: Any, header: dict, rank: int) -> str | None:
    """A line when this rank does not see what rank 0 sees (the source, DST's staging area)."""
    host = socket.gethostname()
    if fingerprint(job.facts()) != header["digest"]:
        return f"rank {rank} on {host} sees {task.src} differently from rank 0 (other files or sizes): every node must see the same path"
    if header["staging"] is not None and _seen_token(header["staging"]) != header["token"]:
        return (
            f"rank {rank} on {host} does not see {header['staging']} as rank 0 wrote it: with local paths every node must see "
            "the same DST (a filesystem all nodes share), with a URL the same bucket; nothing committed"
        )
    return None


def _seen_token(location: str) -> str | None:
    staging = staging_at(location)
    try:
        return staging.token()
    finally:
        staging.close()


def run_ranks(task: SpreadTask, comm: Any, show: ByteProgress | None = None) -> SpreadResult | None:
    """This rank's part of the run (see the module docstring); rank 0 returns the result. The
    other ranks open the source while rank 0 plans (or, where rank 0 hands the job to its node's
    ranks, take it from the broadcast); on one node rank 0 starts on its parts while they do,
    and learns what they saw (`Views`) between its parts."""
    header, job, problem, marks, takes, held, prepared = None, None, None, Marks(), None, ExitStack(), None
    marks.mark("begun")
    try:
        if comm.rank == 0:
            header, job, prepared = _lead(task, comm, marks, held)
        else:
            takes = handed_job_class(task.command, task.src, task.request) if getattr(comm, "hands_job", False) else None
            if takes is None:
                job = open_task_job(task)
                marks.mark("opened")
    except FsdpkitError as error:
        problem = f"rank {comm.rank} on {socket.gethostname()}: {error}"
    header = comm.broadcast(header)
    try:
        if header["error"] is not None:
            _raise(*header["error"])
        if takes is not None and problem is None:
            job, problem = _taken_or_opened(task, takes, header.get("handed"), comm.rank)
            marks.mark("opened")
        marks.setdefault("planned", time.monotonic())
        try:
            problem = problem or (view_problem(task, job, header, comm.rank) if job is not None else None)
        except FsdpkitError as error:
            problem = f"rank {comm.rank} on {socket.gethostname()}: {error}"
        views = Views(comm, problem)
        if views.ready() or job is None:
            views.check()
        staging = prepared or (staging_at(header["staging"]) if header["staging"] else None)  # rank 0's own holds the lease
        try:
            return _work_and_commit(task, job, header, comm, show, views, staging, marks)
        except StoreGone as error:
            raise StoreGone(f"{error}{_kept_note(staging)}") from None
        finally:
            if staging is not None:
                staging.close()  # a bucket's: this rank's scratch
    finally:
        if job is not None:
            job.close()
        held.close()


def _taken_or_opened(task: SpreadTask, where: str, handed: Any, rank: int) -> tuple[Any, str | None]:
    """The job of class `where` that rank 0 handed, or (when it handed none) opened here; or this rank's line."""
    try:
        return (job_class(where).taken(handed) if handed is not None else open_task_job(task)), None
    except FsdpkitError as error:
        return None, f"rank {rank} on {socket.gethostname()}: {error}"


class Views:
    """Every rank's line when it does not see what rank 0 sees, gathered: at once, or, where the
    coordination can gather later (rank 0's hub), as soon as every rank has given its own."""

    def __init__(self, comm: Any, problem: str | None):
        later = getattr(comm, "gather_later", None)
        if later is None:
            values = comm.all_gather(problem)
            self.ready, self.values = (lambda: True), (lambda: values)
        else:
            self.ready, self.values = later(problem)

    def check(self) -> None:
        problems = [line for line in self.values() if line]
        if problems:
            raise RunError(problems[0])


def _work_and_commit(
    task: SpreadTask,
    job: Any,
    header: dict,
    comm: Any,
    show: ByteProgress | None,
    views: Views,
    staging: Staging | BucketStaging | None,
    marks: Marks,
) -> SpreadResult | None:
    plan = Plan.from_json(header["plan"])
    kept = {(r["file"], r["index"]): PartResult(**r) for r in header["kept"]}
    mine = plan.parts_of(comm.rank)
    todo = [part for part in mine if (part.file, part.index) not in kept]
    left = plan.total_bytes - sum(r.end - r.begin for r in kept.values())
    total = job.source_bytes * left // max(1, plan.total_bytes)  # the count is of source bytes read
    count = SharedCount(comm.store, rank=comm.rank, world_size=comm.world_size, key="fsdpkit-spread", show=show, total=total)
    figures = RankFigures(comm.rank, socket.gethostname(), len(mine), len(mine) - len(todo), sum(p.nbytes for p in mine), marks=marks)
    figures.opened_source = not getattr(job, "taken_from_rank_0", False)
    marks.mark("working")
    try:
        results, failure = _run_parts(task, job, plan, todo, staging, count, views, figures)
        marks.mark("worked")
        figures.seconds = marks["worked"] - marks["working"]
        used = resource.getrusage(resource.RUSAGE_SELF)
        figures.peak_rss_bytes, figures.cpu_seconds = peak_rss_bytes(), round(used.ru_utime + used.ru_stime, 3)
        figures.run_delay_seconds, figures.main_thread_cpu_seconds = round(run_delay_seconds(), 3), round(thread_cpu_seconds(), 3)
        figures.torch = "torch" in sys.modules
        gathered = _gather_naming_the_stopped(comm, count, (failure, results, figures))
    finally:
        count.stop()  # rank 0's bar counts the other ranks' bytes until they have all reported
    marks.mark("gathered")
    failures = [f for f, _, _ in gathered if f is not None]
    if failures:
        more = f" (+{count_of(len(failures) - 1, 'more rank')} failed)" if len(failures) > 1 else ""
        kind = failures[0][0]
        _raise(kind, failures[0][1] + more + _kept_note(staging, damaged=task.src if kind == "DataCheckError" else None))
    if comm.rank != 0:
        return None
    done = [*kept.values(), *(r for _, rs, _ in gathered for r in rs)]
    ranks = [f for _, _, f in gathered]
    if staging is None:
        report = job.report(done)
    else:
        assert task.dst is not None
        try:
            report = staging.commit_job(job, done, task.dst, overwrite=task.overwrite)
        except DataCheckError as error:  # a source checksum of pieces read in parts
            raise DataCheckError(f"{error}{_kept_note(staging, damaged=task.src)}") from None
    ranks[0].marks = {**marks, "committed": time.monotonic()}
    return SpreadResult(report, plan, ranks, len(kept), sum(f.bytes_read for f in ranks), staging.where if staging else None)


def _kept_note(staging: Staging | BucketStaging | None, damaged: str | None = None) -> str:
    """What the staging area keeps and what continues it; after a check of the source `damaged`
    failed, that it must be repaired first (a repaired source's files have new modification
    times: another conversion, which --restart begins again)."""
    if staging is None:
        return ""
    if damaged is not None:
        return (
            f"; nothing committed; repair {damaged} (`fsdpkit verify {damaged}` names what is damaged), then run the same "
            f"command again with --restart (a repaired source counts as another conversion: the parts finished in {staging.where} "
            "are written again)"
        )
    return f"; nothing committed; the parts finished are kept in {staging.where}: run the same command again to continue"


def _run_parts(
    task: SpreadTask,
    job: Any,
    plan: Plan,
    todo: list,
    staging: Staging | BucketStaging | None,
    count: SharedCount,
    views: Views,
    figures: RankFigures,
):
    """This rank's parts written (or checked) and recorded: (their results, the first failure);
    a line of `views` (another rank does not see what rank 0 sees) is raised between parts. A
    local staging area's records are made by a `PartRecorder` while the next part is written."""
    results: list[PartResult] = []
    failure = None
    recorder = PartRecorder(staging.record) if isinstance(staging, Staging) else None
    count.post()
    count.start()
    try:
        for number, part in enumerate(todo, 1):
            if views.ready():
                views.check()
            if recorder is not None and recorder.failure(wait=False) is not None:
                break  # named below
            try:
                count.begin_part(plan.label(part))
                faults.reached(task.command, number)
                if staging is None:
                    result = job.run_part(part, None, count.add)
                else:
                    result = staging.write_part(job, part, count.add)
                    if recorder is not None:
                        recorder.add(part, result)
                    else:
                        staging.record(result)
            except RECORDED_ERRORS as error:
                failure = _part_failure(plan, part, figures, error)
                break
            results.append(result)
            figures.bytes_read += result.bytes_read
        unrecorded = recorder.failure(wait=True) if recorder is not None else None
        if unrecorded is not None and failure is None:
            failure = _part_failure(plan, unrecorded[0], figures, unrecorded[1])
        views.check()
        count.finished()
    finally:
        if recorder is not None:
            recorder.close()
        count.post()
    return results, failure


RECORDED_ERRORS = (FsdpkitError, OSError, ValueError, AssertionError)  # a part's failure, named; anything else propagates


def _part_failure(plan: Plan, part: Part, figures: RankFigures, error: BaseException) -> tuple[str, str]:
    if not isinstance(error, RECORDED_ERRORS):
        raise error
    kind = type(error).__name__ if isinstance(error, FsdpkitError) else "RunError"
    return kind, f"rank {figures.rank} on {figures.host}: {plan.label(part)}: {error}"


def _gather_naming_the_stopped(comm: Any, count: SharedCount, value: Any) -> list[Any]:
    """The last gather; when it fails, the ranks that never finished their parts (dead, or
    stuck past --timeout) named with the part each was writing."""
    try:
        return comm.all_gather(value)
    except RunError as error:
        try:
            stopped = count.unfinished() if count.store is not None else []
        except Exception:  # the store went down with rank 0: the gather's own line is all there is
            stopped = []
        if isinstance(error, RankGone):  # the hub knows which rank left; the others are still at work
            stopped = [(rank, label) for rank, label in stopped if rank == error.rank]
        if not stopped:
            raise
        named = "; ".join(f"rank {rank} stopped" + (f" while writing {label}" if label else "") for rank, label in stopped)
        raise RunError(f"{named} (it died, or did not answer within the timeout); nothing committed") from None


def spread_worker(task: SpreadTask) -> SpreadResult | None:
    """A worker's run: the process group from the launcher's (or torchrun's) environment."""
    import datetime
    import os

    os.environ.setdefault("TORCH_CPP_LOG_LEVEL", "ERROR")  # else each call to a store that died warns with a C++ backtrace
    import torch.distributed as dist

    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=task.timeout))
    show, close = stderr_progress(task.command) if dist.get_rank() == 0 else (None, lambda: None)
    try:
        return run_ranks(task, Group(task.timeout), show)
    finally:
        close()
        dist.destroy_process_group()


def failed_part_line(task: SpreadTask, line: str, *, counted: bool = True) -> str:
    """A launch's failure line, with what this run's staging area keeps (a rerun continues from
    it; `counted`: how many parts, which only rank 0 counts once every rank has stopped) and,
    where a worker rank failed, the part it was writing."""
    if not task.writes or task.dst is None or "run the same command again" in line:
        return line
    staging = staging_at(task.dst if task.to_bucket else str(staging_path(Path(task.dst))))
    try:
        plan = Plan.from_json(json.loads(staging.read_state(PLAN_FILE) or ""))
        kept = kept_parts(plan, staging.records())
    except (FsdpkitError, ValueError, KeyError):
        return line
    finally:
        staging.close()
    found = re.search(r"worker rank (\d+)", line)
    left = [part for part in plan.parts_of(int(found.group(1))) if (part.file, part.index) not in kept] if found else []
    where = f" while writing {plan.label(left[0])}" if left and "while writing" not in line else ""
    nothing = "" if "nothing committed" in line else "; nothing committed"
    kept_here = f"{len(kept)} of {len(plan.parts)} parts are kept" if counted else "the parts finished are kept"
    return f"{line}{where}{nothing}; {kept_here} in {staging.where}: run the same command again to continue (--restart starts over)"


def as_json(result: SpreadResult) -> dict:
    shares = result.plan.rank_bytes()
    return {
        "world_size": result.plan.world_size,
        "largest_share_vs_mean": round(result.plan.imbalance, 4),
        "kept_parts": result.kept_parts,
        "bytes_read": result.bytes_read,
        "ranks": [{**asdict(f), "share_bytes": shares[f.rank]} for f in result.ranks],
        "notes": list(result.plan.notes),
    }


def run_spread(
    task: SpreadTask, options: LaunchOptions, show: ByteProgress | None = None, early: EarlyWorkers | None = None
) -> SpreadResult | None:
    """The run in this process (world size 1), with its workers on this node (those of `early`
    that the command line started already, and more if it needs them) and the other nodes' ranks
    (`run_on_nodes`), or, under torchrun, as one worker of it; rank 0's result (None on the other
    ranks and nodes)."""
    if under_torchrun():
        return spread_worker(task)
    if options.nnodes == 1 and options.nproc_per_node == 1:
        return run_ranks(task, Solo(), show)
    return run_on_nodes(task, options, early)


def run_on_nodes(task: SpreadTask, options: LaunchOptions, early: EarlyWorkers | None = None) -> SpreadResult | None:
    """This node's ranks: the first is this process, the others (`processes`) are started first
    (or were, by the command line: `early`), so that they start and open the source while rank 0
    opens it and plans. Node 0's first is rank 0, which serves the hub (`_rank_0_hub`). Bad input
    is rank 0's one line; the other ranks then leave, having written nothing."""
    per_node, world_size = options.local_processes, options.world_size
    first = options.node_rank * per_node
    hub, address, key = _rank_0_hub(task, options, first)
    show, close = stderr_progress(task.command) if hub is not None else (None, lambda: None)
    connected: list[Hub | HubClient] = [hub] if hub is not None else []  # once this node's first rank joined the run
    processes: dict = {}
    grace = 0.5 if options.nnodes == 1 else WORKERS_EXIT_SECONDS  # on failure: other nodes' ranks get the line
    try:
        try:
            processes = start_workers(address, key, range(first + 1, first + per_node), world_size, task.timeout, early)
            if hub is not None:
                hub.processes.update(processes)
            else:
                connected.append(HubClient(address, key, first, world_size, task.timeout))
            result = run_ranks(connected[0].task, connected[0], show)
            grace = WORKERS_EXIT_SECONDS
            return result
        finally:
            close()
            if hub is not None:
                hub.wait_until_left(grace)
                if options.nnodes > 1:  # a rank given twice, still trying to join, hears it was (rather than that no one listens)
                    time.sleep(LATE_JOIN_SECONDS)
            stop_workers(processes, grace=grace)
            for connection in connected:
                connection.close()
    except RunError as error:  # the parts kept counted by rank 0 once every rank has stopped; the other nodes say where they are
        if not connected:  # refused, or no rank 0 answered: this node has no part in the run rank 0 keeps
            raise
        raise RunError(failed_part_line(task, str(error), counted=hub is not None)) from None


def _rank_0_hub(task: SpreadTask, options: LaunchOptions, first: int) -> tuple[Hub | None, tuple[str, int], bytes]:
    """Node 0's hub (None on the other nodes), where this node's ranks reach it, and its key. On
    one node: a free local port, a key made for the run. Across nodes: --master-port of every
    interface, reached at --master-addr, with a key every node derives from the run's arguments
    (and $FSDPKIT_SPREAD_KEY): a node given another command is refused. The address is not in
    the key: a node reaches the hub there whatever its spelling (localhost, 127.0.0.1, a name),
    and a hub of another run cannot listen on the same port of that host."""
    if options.nnodes == 1:
        hub = Hub(options.world_size, task.timeout, task, hands_job=True)
        return hub, hub.address, hub.key
    host, _, port = (options.endpoint or "").rpartition(":")
    key = shared_key(port, str(options.world_size), repr(task))
    if first != 0:
        return None, (host, int(port)), key
    hub = Hub(options.world_size, task.timeout, task, listen=("", int(port)), key=key)
    return hub, ("127.0.0.1", int(port)), key
