"""`fsdpkit plan --time | --recommend | --scaling`: call the step-time model, format its answer."""

from __future__ import annotations

import typer

from fsdpkit.errors import UsageError
from fsdpkit.sizes import format_size

from .common import print_json


def run_time_plan(request, *, hardware: str | None, nodes: int | None, recommend: bool, scaling: str | None, json_output: bool) -> None:
    from fsdpkit.plan.predict import model_costs, predict
    from fsdpkit.plan.profile import load, ranks_per_node
    from fsdpkit.plan.search import parse_world_sizes
    from fsdpkit.plan.search import recommend as search
    from fsdpkit.plan.search import scaling as scale

    if hardware is None:
        raise UsageError("plan --time needs --hardware: a built-in profile or a FILE.toml from --calibrate")
    profile = load(hardware)
    sizes = parse_world_sizes(scaling) if scaling is not None else None
    per_node = ranks_per_node(profile, request.world_size, nodes)
    costs = model_costs(request)
    base = predict(request, profile, costs, per_node=per_node)
    document = base.to_document()
    if sizes is not None:
        document["scaling"] = [_point(p) for p in scale(request, profile, costs, sizes, per_node=per_node)]
    if recommend:
        document["recommend"] = [_choice(p) for p in search(request, profile, costs, per_node=per_node)]
    if json_output:
        print_json({"command": "plan", **document})
        return
    typer.echo(format_time(document))


def _point(prediction) -> dict:
    document = prediction.to_document()
    keys = ("world_size", "step_time_s", "exposed_comm_s", "tflops_per_device", "mfu", "tokens_per_s_per_device", "fits")
    return {key: document[key] for key in keys}


def _choice(prediction) -> dict:
    sharding, request = prediction.request.sharding, prediction.request
    flags = [f"--strategy {sharding.strategy}"]
    if sharding.shard_group_size is not None:
        flags.append(f"--shard-group-size {sharding.shard_group_size}")
    flags.append(f"--backward-prefetch {sharding.backward_prefetch}")
    flags += ["--forward-prefetch"] * sharding.forward_prefetch + [f"--limit-all-gathers {sharding.limit_all_gathers}"]
    flags += ["--activation-checkpointing"] * sharding.activation_checkpointing + [f"--grad-accum {request.grad_accum}"]
    return {"flags": " ".join(flags), "micro_batch": prediction.micro_batch, "step_time_s": prediction.time.step_time_s}


def _terms(document: dict) -> list[str]:
    """The compute time by part; the memory rate those bound by bandwidth run at."""
    from fsdpkit.plan.simulate import TERMS

    lines = [f"    {seconds:<10.4g} s {TERMS[term]}" for term, seconds in document["terms"].items() if seconds]
    rates = document["rates"]
    return [
        *lines,
        f"    (peak {rates['peak_tflops']:,.4g} TFLOPS x efficiency {rates['efficiency']:.3g}; memory rate: "
        f"{rates['memory_bw_gbs']:,.4g} GB/s x memory_efficiency {rates['memory_efficiency']:.3g})",
    ]


def format_time(document: dict) -> str:
    lines = [
        f"# fsdpkit plan --time: {document['model']}, {document['num_params']:,} parameters in {document['units']} units; "
        f"world size {document['world_size']}, {document['strategy']}, mixed precision {document['mixed_precision']}",
        f"# on {document['hardware']} ({document['ranks_per_node']} ranks per node); micro-batch {document['micro_batch']} x "
        f"{document['seq_len']} tokens per rank, grad accum {document['grad_accum']}",
        f"  step time                {document['step_time_s']:.4g} s",
        f"  compute                  {document['compute_s']:.4g} s",
        *_terms(document),
        f"  exposed communication    {document['exposed_comm_s']:.4g} s (the communication stream is busy {document['comm_s']:.4g} s)",
        f"  TFLOPS per device        {document['tflops_per_device']:.4g} (MFU {document['mfu']:.1%})",
        f"  tokens/s                 {document['tokens_per_s']:,.0f} ({document['tokens_per_s_per_device']:,.0f} per device)",
        f"  memory per rank          {format_size(document['bytes']['device_total'])} on the device"
        + f" + {format_size(document['activation_bytes'])} activations (estimate)"
        + ("" if document["fits"] else " (does not fit)"),
        "  bytes per rank and step  " + (", ".join(f"{kind} {format_size(n)}" for kind, n in document["comm_bytes"].items()) or "none"),
    ]
    if "scaling" in document:
        lines += [
            "# scaling (same micro-batch per rank)",
            f"  {'world size':>10} {'step s':>10} {'TFLOPS/dev':>11} {'MFU':>6} {'tokens/s/dev':>13}",
        ]
        for point in document["scaling"]:
            lines.append(
                f"  {point['world_size']:>10,} {point['step_time_s']:>10.4g} {point['tflops_per_device']:>11.4g} "
                f"{point['mfu']:>6.1%} {point['tokens_per_s_per_device']:>13,.0f}" + ("" if point["fits"] else "  (does not fit)")
            )
    if "recommend" in document:
        lines.append("# fastest configurations that fit (predicted step time)")
        lines += [f"  {choice['step_time_s']:.4g} s  {choice['flags']}" for choice in document["recommend"]] or ["  none fits"]
    return "\n".join(lines)
