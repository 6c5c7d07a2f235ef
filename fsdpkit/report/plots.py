"""Pictures for `fsdpkit report`: a training run's --metrics JSON lines (loss, tokens/s, learning
rate, memory against step), a `bench --json` document (busbw against size per collective,
flat against list all-gather) or a `plan --scaling --json` document (TFLOPS per device against
world size). matplotlib is an optional extra, `plot`."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from ..errors import UsageError, install_hint


def read_report_input(path: Path) -> tuple[str, Any]:
    """("metrics", [record, ...]), ("bench", document) or ("scaling", plan --scaling --json
    document); UsageError for anything else."""
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as error:
        raise UsageError(f"cannot read {str(path)!r}: {getattr(error, 'strerror', None) or error}") from None
    try:
        document = json.loads(text)
    except ValueError:
        document = None
    if isinstance(document, dict) and document.get("command") == "bench" and isinstance(document.get("results"), list):
        return "bench", document
    if isinstance(document, dict) and document.get("command") == "plan" and isinstance(document.get("scaling"), list):
        return "scaling", document
    records = []
    for number, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except ValueError:
            record = None
        if not (isinstance(record, dict) and isinstance(record.get("step"), int)):
            raise UsageError(
                f"{str(path)!r} line {number} is not a metrics record (train --metrics) and the file is not a bench --json document"
            )
        records.append(record)
    if not records:
        raise UsageError(f"{str(path)!r} holds no metrics records")
    return "metrics", records


def _pyplot() -> Any:
    try:
        import matplotlib
    except ImportError:
        raise UsageError(f"fsdpkit report draws with matplotlib, which is not installed: {install_hint('plot')}") from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _series(records: list[dict], key: str) -> tuple[list[int], list[float]]:
    points = [(r["step"], r[key]) for r in records if isinstance(r.get(key), (int, float))]
    return [s for s, _ in points], [v for _, v in points]


def plot_metrics(records: list[dict], out: Path) -> None:
    plt = _pyplot()
    figure, axes = plt.subplots(2, 2, figsize=(11, 7), sharex=True)
    loss, rate, lr, memory = axes.flat
    loss.plot(*_series(records, "loss"), label="train")
    steps, evals = _series(records, "eval_loss")
    if steps:
        loss.plot(steps, evals, "o-", label="eval (held out)")
    loss.set_title("loss")
    loss.legend()
    rate.plot(*_series(records, "tokens_per_second"))
    rate.set_title("tokens/s (global batch)")
    lr.plot(*_series(records, "lr"))
    lr.set_title("learning rate")
    steps, peak = _series(records, "peak_memory_bytes")
    memory.plot(steps, [value / 2**20 for value in peak])
    memory.set_title("peak memory, rank 0 (MiB)")
    for axis in (lr, memory):
        axis.set_xlabel("step")
    figure.tight_layout()
    figure.savefig(out, format="png", dpi=100)
    plt.close(figure)


def plot_bench(document: dict, out: Path) -> None:
    plt = _pyplot()
    results = document["results"]
    variants = {r["variant"]: r for r in results if r["collective"] == "allgather" and r.get("variant")}
    compare = {"flat", "list"} <= variants.keys()
    figure, axes = plt.subplots(1, 2 if compare else 1, figsize=(13 if compare else 8, 5), squeeze=False)
    busbw = axes[0][0]
    for result in results:
        name = result["collective"] + (f" ({result['variant']})" if result.get("variant") else "")
        color = None  # one color per collective: solid out-of-place, dashed in-place
        for mode, style in (("out_of_place", "-"), ("in_place", "--")):
            rows = [row for row in result["rows"] if row.get(mode)]
            if rows:
                (line,) = busbw.plot(
                    [row["size_bytes"] for row in rows],
                    [row[mode]["busbw_gbps"] for row in rows],
                    style,
                    marker="o",
                    color=color,
                    label=f"{name}, {mode.replace('_', '-')}",
                )
                color = line.get_color()
    busbw.set_xscale("log", base=2)
    busbw.set_xlabel("size (bytes)")
    busbw.set_ylabel("busbw (GB/s)")
    busbw.set_title(f"busbw, {document['world_size']} ranks, {document['backend']}, {document['dtype']}")
    busbw.legend(fontsize="small")
    if compare:
        ratio = axes[0][1]
        for mode, style in (("out_of_place", "-"), ("in_place", "--")):
            pairs = [
                (flat, listed)
                for flat, listed in zip(variants["flat"]["rows"], variants["list"]["rows"], strict=False)
                if flat.get(mode) and listed.get(mode)
            ]
            ratio.plot(
                [flat["size_bytes"] for flat, _ in pairs],
                [listed[mode]["time_us"] / flat[mode]["time_us"] for flat, listed in pairs],
                style,
                marker="o",
                label=mode.replace("_", "-"),
            )
        ratio.axhline(1.0, color="grey", linewidth=0.8)
        ratio.set_xscale("log", base=2)
        ratio.set_xlabel("size (bytes)")
        ratio.set_ylabel("list time / flat time")
        ratio.set_title("all-gather: list against flat (above 1: flat is faster)")
        ratio.legend()
    figure.tight_layout()
    figure.savefig(out, format="png", dpi=100)
    plt.close(figure)


def plot_scaling(document: dict, out: Path) -> None:
    """Predicted TFLOPS per device (and MFU) against world size, from plan --scaling --json."""
    plt = _pyplot()
    points = document["scaling"]
    figure, axes = plt.subplots(figsize=(8, 5))
    axes.plot([p["world_size"] for p in points], [p["tflops_per_device"] for p in points], marker="o")
    for point in points:
        axes.annotate(f"{point['mfu']:.0%}", (point["world_size"], point["tflops_per_device"]), fontsize="small")
    axes.set_xscale("log")
    axes.set_xlabel("world size (ranks)")
    axes.set_ylabel("predicted TFLOPS per device (labels: MFU)")
    axes.set_title(f"{document['model']}, {document['strategy']}, on {document['hardware']}")
    figure.tight_layout()
    figure.savefig(out, format="png", dpi=100)
    plt.close(figure)
