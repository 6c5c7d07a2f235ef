"""`fsdpkit diff A B`: compare two checkpoints of any format, tensor by tensor (exit 0 equal, 3 not)."""

from __future__ import annotations

from typing import Any

import typer

from fsdpkit.progress import byte_progress

from .checkpoint_options import MODEL_KEY_HELP, OPTIMIZER_KEY_HELP, chunk_bytes
from .common import print_json
from .spread_options import DryRun, launch_options, run_spread_command, spread_command

SHOWN = 20  # differing tensors listed in the text output


def _line(result: dict) -> str:
    status = result["status"]
    if status == "different" or status == "close":
        return f"{status:9} {result['name']}: max abs {result['max_abs']:.3g}, max rel {result['max_rel']:.3g}"
    if status in ("dtype", "shape"):
        transposed = " (a transpose)" if result.get("transposed") else ""
        return f"{status:9} {result['name']}: {result['a']} vs {result['b']}{transposed}"
    return f"{status:9} {result['name']}"


def diff_command(
    ctx: typer.Context,
    a: str = typer.Argument(..., help="A checkpoint: fsdpkit sharded (run or step dir), full safetensors, torch DCP or DeepSpeed ZeRO."),
    b: str = typer.Argument(..., help="The checkpoint to compare it with (any of the same formats)."),
    atol: float = typer.Option(0.0, "--atol", help="Absolute tolerance: equal when |a - b| <= atol + rtol * |b|."),
    rtol: float = typer.Option(0.0, "--rtol", help="Relative tolerance."),
    model_only: bool = typer.Option(False, "--model-only", help="Compare the model tensors only (no optimizer state)."),
    chunk_size: str = typer.Option("4M", "--chunk-size", help="Bytes of each side compared at a time; bounds memory."),
    as_json: bool = typer.Option(False, "--json", help="Print the comparison as one JSON document."),
    dcp_model_key: str | None = typer.Option(None, "--dcp-model-key", help=MODEL_KEY_HELP),
    dcp_optimizer_key: str | None = typer.Option(None, "--dcp-optimizer-key", help=OPTIMIZER_KEY_HELP),
    dry_run: DryRun = False,
    **settings: Any,
) -> None:
    """Compare two checkpoints of any format tensor by tensor; exit 0 when equal within the tolerance, 3 when not.

    Each tensor is bitwise equal, within the tolerance (close), different (max abs and max rel difference), of another
    dtype or shape, or present in one checkpoint only."""
    from fsdpkit.checkpoint.offline.diff import DiffRequest, Tolerance
    from fsdpkit.checkpoint.offline.locations import diff_at

    chunk = chunk_bytes(chunk_size)
    request = DiffRequest(b, Tolerance(atol, rtol), model_only, (dcp_model_key, dcp_optimizer_key), chunk)
    options = launch_options(ctx, settings, dry_run=dry_run, restart=False, spreads=lambda: True, locations=(a, b))[0]
    if options is not None:
        from fsdpkit.checkpoint.spread.runner import SpreadTask  # the spread machinery: imported by a spread run only

        result = run_spread_command(
            SpreadTask("diff", str(a), request=request, chunk_size=chunk), options, dry_run=dry_run, as_json=as_json, early=ctx.obj
        )
        if result is None:
            return
    else:
        with byte_progress("diff") as progress:
            result = diff_at(a, request, progress)
    if as_json:
        print_json(result)
    else:
        shown = [r for r in result["tensors"] if r["status"] != "equal"]
        lines = [_line(r) for r in shown[:SHOWN]]
        if len(shown) > SHOWN:
            lines.append(f"... {len(shown) - SHOWN} more")
        lines += [f"names of {side}: {note}" for side, note in result["names"].items()]
        lines += [f"names: {hint}" for hint in result["hints"]]
        counts = ", ".join(f"{count} {status}" for status, count in sorted(result["counts"].items()))
        verdict = "equal" if result["equal"] else "not equal"
        lines.append(f"{verdict}: {result['a']['format']} {result['a']['path']} vs {result['b']['format']} {result['b']['path']}: {counts}")
        typer.echo("\n".join(lines))
    if not result["equal"]:
        raise typer.Exit(3)


command_app = spread_command("diff", diff_command)
