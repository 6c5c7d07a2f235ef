"""gpu_check.sh's report: each part's outcome (its exit status, seconds, and the error where it
failed) and what it measured, as one JSON document (gpu-check.json) and a table (gpu-check.md,
printed), with the plan's step against the engine's measured one.

    .venv/bin/python benchmarks/plan_gpu_check.py gpu-check-results
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

RUNS = ("plain", "snapshot", "async_save", "compile")
RUN_FIELDS = ("elapsed_seconds", "tokens_per_second", "step_tokens_per_second", "save_stall_s", "snapshot_stall_s", "lr")


def read_parts(results: Path) -> dict[str, dict[str, Any]]:
    """Each part's exit status, seconds, output document (None where there is none) and error."""
    parts: dict[str, dict[str, Any]] = {}
    tsv = results / "parts.tsv"
    for line in tsv.read_text().splitlines() if tsv.exists() else []:
        name, rc, seconds = line.split("\t")
        part: dict[str, Any] = {"rc": int(rc), "seconds": int(seconds), "document": _document(results / f"{name}.out")}
        if part["rc"]:
            err = results / f"{name}.err"
            lines = err.read_text(errors="replace").strip().splitlines() if err.exists() else []
            part["error"] = "timed out" if part["rc"] == 124 else (lines[-1] if lines else f"exit {rc}")
        parts[name] = part
    return parts


def _document(path: Path) -> Any:
    """The last line of `path` that is a JSON document."""
    for line in reversed(path.read_text(errors="replace").splitlines() if path.exists() else []):
        if line.startswith("{"):
            try:
                return json.loads(line)
            except json.JSONDecodeError:
                return None
    return None


def compat(parts: dict) -> dict[str, Any]:
    """The resumed run's losses against the straight run's from step 21."""
    straight, resumed = (parts.get(name, {}).get("document") for name in ("compat_straight", "compat_resume"))
    if not straight or not resumed:
        return {"bitwise_equal": None}
    tail = straight["losses"][len(straight["losses"]) - len(resumed["losses"]) :]
    return {"bitwise_equal": tail == resumed["losses"], "steps_compared": len(resumed["losses"])}


def snapshot_check(parts: dict) -> dict[str, Any]:
    """Whether the async save and the snapshot copied while the GPU trained on hold their step, bitwise."""
    document = parts.get("snapshot_check", {}).get("document")
    if not document:
        return {"holds_its_step": None}
    return {key: document[key] for key in ("holds_its_step", "step", "async_save", "snapshot")}


def engine(parts: dict) -> list[dict[str, Any]]:
    document = parts.get("engine", {}).get("document") or {}
    keys = ("system", "step_ms_median", "step_ms_min", "step_ms_max", "model_tflops_per_gpu", "mfu", "peak_bytes_per_rank")
    return [{key: row.get(key) for key in keys} for row in document.get("rows", [])]


def runs(parts: dict) -> dict[str, dict[str, Any]]:
    """The training runs' summaries, each against the plain run."""
    found = {name: parts[name]["document"] for name in RUNS if (parts.get(name) or {}).get("document")}
    plain = found.get("plain")
    out = {}
    for name, document in found.items():
        row = {key: document.get(key) for key in RUN_FIELDS}
        if plain and name != "compile":
            row["elapsed_vs_plain"] = document["elapsed_seconds"] / plain["elapsed_seconds"]
        if plain and document.get("tokens_per_second") and plain.get("tokens_per_second"):
            row["tokens_per_second_vs_plain"] = document["tokens_per_second"] / plain["tokens_per_second"]
        out[name] = row
    return out


def plan(parts: dict, measured: list[dict[str, Any]]) -> dict[str, Any]:
    document = parts.get("plan", {}).get("document")
    if not document:
        return {}
    out = {key: document[key] for key in ("hardware", "step_time_s", "mfu", "terms")}
    fsdpkit = next((row for row in measured if row["system"] == "fsdpkit"), None)
    if fsdpkit and fsdpkit.get("step_ms_median"):
        out["measured_step_s"] = fsdpkit["step_ms_median"] / 1e3
        out["predicted_over_measured"] = document["step_time_s"] / out["measured_step_s"]
    return out


def table(report: dict[str, Any]) -> str:
    lines = [f"# gpu_check on {report['device'].get('gpu', '?')} (torch {report['device'].get('torch', '?')})", ""]
    lines += ["| part | rc | seconds | error |", "| --- | ---: | ---: | --- |"]
    lines += [f"| {name} | {p['rc']} | {p['seconds']} | {p.get('error', '')} |" for name, p in report["parts"].items()]
    lines += ["", f"save at 20, resume to 40: losses bitwise equal: {report['compat']['bitwise_equal']}"]
    lines += [f"async save and snapshot copied while training: hold their step bitwise: {report['snapshot_check']['holds_its_step']}", ""]
    lines += ["| system | step ms (min-max) | TFLOP/s | MFU | peak GiB |", "| --- | ---: | ---: | ---: | ---: |"]
    for row in report["engine"]:
        peak = (row["peak_bytes_per_rank"] or 0) / 2**30
        lines.append(
            f"| {row['system']} | {row['step_ms_median']:.1f} ({row['step_ms_min']:.1f}-{row['step_ms_max']:.1f}) | "
            f"{row['model_tflops_per_gpu'] or 0:.0f} | {row['mfu'] or 0:.1%} | {peak:.1f} |"
        )
    lines += ["", "| run | elapsed s | tokens/s | step tokens/s | vs plain (elapsed) |", "| --- | ---: | ---: | ---: | ---: |"]
    for name, row in report["runs"].items():
        vs = row.get("elapsed_vs_plain")
        lines.append(
            f"| {name} | {row['elapsed_seconds']:.1f} | {row['tokens_per_second'] or 0:,.0f} | "
            f"{row['step_tokens_per_second'] or 0:,.0f} | {f'{vs:.3f}x' if vs else ''} |"
        )
    planned = report["plan"]
    if "predicted_over_measured" in planned:
        lines += [
            "",
            f"plan --time on {planned['hardware']}: {planned['step_time_s']:.4f} s predicted, {planned['measured_step_s']:.4f} s "
            f"measured ({planned['predicted_over_measured']:.2f}x)",
        ]
    return "\n".join(lines)


def main() -> None:
    results = Path(sys.argv[1] if len(sys.argv) > 1 else "gpu-check-results")
    parts = read_parts(results)
    device = _document(results / "device.json") or {}
    measured = engine(parts)
    report = {
        "device": device,
        "parts": {name: {k: v for k, v in part.items() if k != "document"} for name, part in parts.items()},
        "compat": compat(parts),
        "snapshot_check": snapshot_check(parts),
        "engine": measured,
        "runs": runs(parts),
        "plan": plan(parts, measured),
    }
    (results / "gpu-check.json").write_text(json.dumps(report, indent=1) + "\n")
    text = table(report)
    (results / "gpu-check.md").write_text(text + "\n")
    print(text)
    sys.exit(sum(1 for part in parts.values() if part["rc"]))


if __name__ == "__main__":
    main()
