"""What convert, reshard, verify and diff share to run spread over processes and nodes: train's launch
flags (--nproc-per-node, --nnodes, --node-rank, --master-addr, --master-port, ...), --dry-run,
and the lines that say how the work was shared. Without any of them (and outside torchrun) the
commands run as they always did, in this process."""

from __future__ import annotations

import dataclasses
import inspect
import os
import sys
from collections.abc import Callable
from typing import Annotated, Any

import typer

from fsdpkit.dist.launch import LaunchOptions, under_torchrun
from fsdpkit.errors import FsdpkitError
from fsdpkit.settings import Section, settings_of
from fsdpkit.sizes import count, format_size

from .common import FsdpkitCommand, handle_errors
from .settings_options import given_values, setting_parameters, with_parameters

LAUNCH_KEYS = ("nproc_per_node", "nnodes", "node_rank", "master_addr", "master_port", "rdzv_endpoint", "rdzv_backend", "rdzv_id", "timeout")
NPROC_HELP = "Processes on this node: a number, gpu, cpu or auto (default 1 on each node, as torchrun's)."  # train's is one per GPU
LAUNCH = Section(
    "launch",
    "Spread over processes and nodes",
    tuple(
        dataclasses.replace(s, help=NPROC_HELP) if s.key == "nproc_per_node" else s
        for s in settings_of(LaunchOptions)
        if s.key in LAUNCH_KEYS
    ),
    LaunchOptions,
    lambda options: {key: getattr(options, key) for key in LAUNCH_KEYS},
)
DryRun = Annotated[
    bool,
    typer.Option(
        "--dry-run",
        help="Print the plan (files and bytes per rank, largest share vs mean, predicted time) and write nothing.",
        rich_help_panel="Spread over processes and nodes",
    ),
]
Restart = Annotated[
    bool,
    typer.Option(
        "--restart",
        help="Discard the partial output an interrupted spread run left beside DST instead of continuing it.",
        rich_help_panel="Spread over processes and nodes",
    ),
]


def launch_options(
    ctx: typer.Context,
    settings: dict[str, Any],
    *,
    dry_run: bool,
    restart: bool,
    spreads: Callable[[], bool],
    locations: tuple[str, ...],
    dst: str | None = None,
) -> tuple[LaunchOptions | None, bool]:
    """The launch of a spread run, or None when nothing asks for one (no launch flag, no
    --dry-run or --restart, not a command that `spreads` started by torchrun as its workers):
    then the command runs as it always did; but a convert or reshard to `dst` runs spread when an
    interrupted spread run left its staging area beside a local DST. And whether that is why
    (`SpreadTask.resumes`). A URL among `locations` that fsdpkit cannot use is one line here,
    before any worker starts."""
    given = given_values((LAUNCH,), ctx, settings).get("launch", {})
    plain = not given and not dry_run and not restart and not (_torchrun_worker() and spreads())
    resumes = plain and _resumes(dst, spreads)
    if plain and not resumes:
        return None, False
    from fsdpkit.checkpoint.offline.locations import check_urls

    check_urls(*locations)
    options = LAUNCH.from_values(given, where="")
    if options.nproc_per_node is None and not under_torchrun():  # one process on each node, as torchrun's default
        options = LAUNCH.from_values({**given, "nproc_per_node": 1}, where="")
    return options, resumes


def _resumes(dst: str | None, spreads: Callable[[], bool]) -> bool:
    """Whether a plain convert or reshard to `dst` runs as `--nproc-per-node 1` because an
    interrupted spread run left its staging area beside DST: the same conversion's finished parts
    are kept (not written again, not left behind), another conversion's area is refused as a
    spread run refuses it. Rank 0 says so in a note once it has found the area this conversion's."""
    if dst is None or under_torchrun():
        return False
    from fsdpkit.checkpoint.spread.staging import resumable_beside

    return resumable_beside(dst) is not None and spreads()


def _torchrun_worker() -> bool:
    """A worker torchrun started, whose process group is not already running (the command may
    be run by code inside another run's worker: it then runs as it always did)."""
    dist = sys.modules.get("torch.distributed")
    return under_torchrun() and not (dist is not None and dist.is_available() and dist.is_initialized())


def spreads_from(command: str, src: Any) -> Callable[[], bool]:
    """Whether `command` (reshard or verify) of `src` spreads (under torchrun, or beside a staging area), asked only there."""

    def spread() -> bool:
        from fsdpkit.checkpoint.offline.formats import detect_format
        from fsdpkit.checkpoint.spread.dispatch import spreads

        try:
            return spreads(command, detect_format(src).name)
        except FsdpkitError:  # the one-process path says what is wrong with it
            return False

    return spread


def spread_target(to: str) -> Callable[[], bool]:
    """Whether `convert --to to` spreads (under torchrun, or beside a staging area), asked only there."""

    def spread() -> bool:
        from fsdpkit.checkpoint.spread.dispatch import SPREAD_TARGETS

        return to in SPREAD_TARGETS

    return spread


def spread_command(name: str, body: Callable[..., Any]) -> typer.Typer:
    """A one-command Typer app: `body(ctx, ..., **settings)` with its own options and the launch flags."""
    own = [p for key, p in inspect.signature(body, eval_str=True).parameters.items() if key != "settings"]
    app = typer.Typer(add_completion=False)
    app.command(name, cls=FsdpkitCommand, help=body.__doc__)(handle_errors(with_parameters(body, own + setting_parameters((LAUNCH,)))))
    return app


def spread_lines(result: Any) -> list[str]:
    """How the work was shared: one line, and the notes of the plan."""
    plan = result.plan
    kept = f", {count(result.kept_parts, 'part')} kept from an earlier run" if result.kept_parts else ""
    share = format_size(max(plan.rank_bytes()))
    line = (
        f"spread over {count(plan.world_size, 'rank')}: largest share {share} = {plan.imbalance:.3f}x the mean, "
        f"{format_size(result.bytes_read)} read{kept}"
    )
    return [line, *(f"note: {note}" for note in plan.notes)]


def run_spread_command(
    task: Any, options: LaunchOptions, *, dry_run: bool, as_json: bool, early: Any = None, one_process: Callable[[], Any] | None = None
) -> Any:
    """Run `task` spread (or print its plan with --dry-run); what convert and reshard print, or
    verify's report, on rank 0; None on the other ranks, and after a dry run. `early`: the
    workers the command line started (`fsdpkit.checkpoint.spread.processes.start_early`).
    `one_process`: the one-process command, which runs where the job is done in one process only
    and the run has one process, or runs under torchrun (rank 0 runs it alone, the other ranks
    leave at once); with more processes of fsdpkit's own launch that is one line and exit 2."""
    from fsdpkit.checkpoint.spread.runner import as_json as figures
    from fsdpkit.checkpoint.spread.runner import run_spread
    from fsdpkit.progress import byte_progress

    task = dataclasses.replace(task, timeout=options.timeout)
    if dry_run:
        _print_plan(task, options, as_json=as_json, one_process=one_process)
        return None
    try:
        if options.nnodes == 1 and options.nproc_per_node == 1 and not under_torchrun():
            with byte_progress(task.command) as progress:  # workers show their own bar, on rank 0
                result = run_spread(task, options, progress)
        else:
            result = run_spread(task, options, early=early)
    except FsdpkitError as error:
        if one_process is not None and _runs_in_one_process(error, options):
            return _alone(error, one_process)
        if under_torchrun() and os.environ.get("RANK") != "0" and not _said_by_every_rank(error):  # the same line comes from rank 0
            raise typer.Exit(error.exit_code) from None
        raise
    if result is None:
        return None
    if not as_json:
        for line in spread_lines(result):
            typer.echo(line, err=True)
    if task.command == "diff":  # its report is the one-process diff's
        return result.report
    if task.command == "verify":
        result.report.extra["spread"] = figures(result)
        return result.report
    return dataclasses.replace(result.report, details={**result.report.details, "spread": figures(result)})


def _print_plan(task: Any, options: LaunchOptions, *, as_json: bool, one_process: Callable[[], Any] | None) -> None:
    """--dry-run: the plan, on rank 0 (or what runs a job done in one process only)."""
    from fsdpkit.checkpoint.spread.dryrun import dry_run as plan_only
    from fsdpkit.checkpoint.spread.runner import open_task_job

    from .common import print_json

    if under_torchrun() and os.environ.get("RANK") != "0":
        return
    try:
        job = open_task_job(task)
    except FsdpkitError as error:
        if one_process is None or not _runs_in_one_process(error, options):
            raise
        why = f"{error.why}{_who_runs_it()}"
        print_json({"dry_run": True, "one_process": why}) if as_json else typer.echo(f"dry run: {why}; nothing to plan, nothing written")
        return
    try:
        world_size = int(os.environ["WORLD_SIZE"]) if under_torchrun() else options.world_size
        planned = plan_only(job, task, world_size)
    finally:
        job.close()
    print_json(planned.to_json()) if as_json else typer.echo("\n".join(planned.lines()))


def _runs_in_one_process(error: FsdpkitError, options: LaunchOptions) -> bool:
    """Whether `error` says the job is done in one process only, and this command runs it so:
    under torchrun (on rank 0 alone), or as one process in all."""
    from fsdpkit.checkpoint.spread.jobs import OneProcessOnly

    return isinstance(error, OneProcessOnly) and (under_torchrun() or options.world_size == 1)


def _who_runs_it() -> str:
    return ": rank 0 runs it alone" if under_torchrun() else ""


def _alone(error: Any, one_process: Callable[[], Any]) -> Any:
    """A job done in one process only: this process runs `one_process` (under torchrun, rank 0:
    the other ranks have nothing to do)."""
    if under_torchrun() and os.environ.get("RANK") != "0":
        return None
    typer.echo(f"note: {error.why}{_who_runs_it()}", err=True)
    return one_process()


def _said_by_every_rank(error: FsdpkitError) -> bool:
    """torchrun's agent died: no rank 0 line stands for the others (no agent stops them)."""
    from fsdpkit.checkpoint.spread.torchrun_group import StoreGone

    return isinstance(error, StoreGone)
