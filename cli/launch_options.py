"""The multi-node launch flags shared by `train` and `bench`."""

from __future__ import annotations

from typing import Annotated, Optional

import typer

NprocOption = Annotated[int, typer.Option("--nproc-per-node", help="Processes per node (one per GPU; on CPU, cores to use).")]
NnodesOption = Annotated[int, typer.Option("--nnodes", help="Number of nodes.")]
NodeRankOption = Annotated[int, typer.Option("--node-rank", help="This node's rank, 0..nnodes-1.")]
RdzvOption = Annotated[Optional[str], typer.Option("--rdzv-endpoint", help="HOST:PORT of the c10d rendezvous (needed with --nnodes > 1).")]
