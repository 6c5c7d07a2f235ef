"""What a backend really runs underneath a collective, where that changes how to read the numbers.

Checked on torch 2.13 (CPU build) with torch.profiler inside a 2-rank gloo run:
reduce_scatter_single records `c10d::_reduce_scatter_base_` followed by `gloo:all_reduce`
(ProcessGroupGloo clones the input, all-reduces the whole tensor, copies out this rank's
chunk; gloo has no reduce-scatter of its own), and all_gather_single
records `gloo:all_gather`, the same work as the list all-gather (ProcessGroupGloo's
_allgather_base chunks the output into a list).
"""

from __future__ import annotations


def backend_note(backend: str, collective: str, variant: str = "") -> str | None:
    """One line for the table when `backend` emulates `collective`, else None."""
    if backend == "gloo" and collective == "reducescatter" and variant == "fsdpkit":
        return "fsdpkit on gloo: point-to-point sends of each chunk to its rank ((n-1)/n of the tensor per rank), summed in place"
    if backend == "gloo" and collective == "reducescatter":
        return (
            "emulated: gloo runs reduce-scatter as an all-reduce of the whole tensor and keeps this rank's chunk "
            "(about twice the traffic); busbw still uses the reduce-scatter factor"
        )
    if backend == "gloo" and collective == "allgather" and variant == "fsdpkit":
        return "fsdpkit on gloo: point-to-point sends of this rank's shard into its place on every other rank"
    if backend == "gloo" and collective == "allgather" and variant == "flat":
        return "gloo runs all_gather_single as its list all-gather over views of the output"
    return None
