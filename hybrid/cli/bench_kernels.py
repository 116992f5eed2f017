"""`hybrid bench-kernels`: CPU matvec speed per weight type and N, against measured bandwidth."""
from __future__ import annotations

from typing import Annotated, Optional

import typer

from ..kernel_bench import run_command
from . import app


@app.command("bench-kernels")
def bench_kernels(
    quick: Annotated[bool, typer.Option("--quick", help="Smaller buffers, fewer repeats, the four target types (under a minute).")] = False,
    as_json: Annotated[bool, typer.Option("--json", help="Print one JSON object on stdout and nothing else.")] = False,
    threads: Annotated[Optional[int], typer.Option("--threads", "-t", help="CPU threads (default: all Numba threads).", show_default=False)] = None,
    types: Annotated[Optional[list[str]], typer.Option("--types", help="Weight types, e.g. --types Q4_K,Q8_0 (default: all; with --quick: Q4_K Q5_K Q6_K Q8_0).", show_default=False)] = None,
) -> None:
    """Time the CPU matvec of each weight type.

    One N-input pass (N = 1, 2, 4, 8) per type at FFN shapes, as GB/s and % of the CPU read
    bandwidth measured in the same run.
    """
    run_command(quick=quick, as_json=as_json, threads=threads, types=types)
