"""`hybrid bench`: llama-bench style table of prompt and generation speed."""
from __future__ import annotations

import csv
import io
import json
import sys
from pathlib import Path
from typing import List, Optional

import typer
from rich.console import Console

from ..bench import bench_draft, bench_generate, bench_prompt
from ..draft_policy import parse_depth
from ..errors import HybridError
from ..model_file import default_model_path, open_model
from . import app
from .common import (CpuOnlyOpt, CudaGraphsOpt, DeviceOpt, ExpertCacheOpt, PcieShareOpt, SplitFfnOpt, ModelArg, ModelOpt, OverrideTensorOpt,
                     ThreadsOpt, VramOpt, load_model, pick_model)

FORMATS = ("md", "csv", "json")


@app.command("bench")
def bench(
    model: Optional[Path] = ModelArg,
    model_opt: Optional[Path] = ModelOpt,
    n_prompt: List[int] = typer.Option([512], "-p", "--n-prompt", min=0, help="Prompt lengths to time (repeatable; 0 skips)."),
    n_gen: List[int] = typer.Option([128], "-n", "--n-gen", min=0, help="Generation lengths to time (repeatable; 0 skips)."),
    draft: List[str] = typer.Option([], "-d", "--draft", help="Also time greedy generation with MTP drafting "
                                    "at this depth (repeatable: -d 1 -d 3 -d auto; 0 = plain, from a code prompt)."),
    reps: int = typer.Option(3, "-r", "--repetitions", help="Repetitions of each test."),
    threads: Optional[int] = ThreadsOpt,
    device: str = DeviceOpt,
    vram: Optional[str] = VramOpt,
    cpu_only: bool = CpuOnlyOpt,
    overrides: List[str] = OverrideTensorOpt,
    cuda_graphs: bool = CudaGraphsOpt,
    expert_cache: bool = ExpertCacheOpt,
    pcie_share: float = PcieShareOpt,
    split_ffn: bool = SplitFfnOpt,
    output: str = typer.Option("md", "-o", "--output", help="Output format: md, csv or json."),
) -> None:
    """Measure prompt processing (ppN) and token generation (tgN) speed, mean ± stdev over repetitions."""
    if output not in FORMATS:
        raise HybridError(f"unknown output format {output!r}; choose one of {', '.join(FORMATS)}")
    if reps < 1:
        raise HybridError(f"-r must be ≥ 1, got {reps}")
    err = Console(stderr=True)
    path = pick_model(model, model_opt)
    for d in draft:
        parse_depth(d)                      # reject bad depths before loading anything
    if not any(n > 0 for n in (*n_prompt, *n_gen)):
        raise HybridError("nothing to time: give a positive -p or -n")
    n_ctx = max([*n_prompt, *n_gen, 1]) + 64
    # the model's context bounds every test; read it from the header before loading anything
    with open_model(path or default_model_path()) as f:
        model_ctx = f.config.context_length
    if n_ctx > model_ctx:
        raise HybridError(f"-p/-n of {max(*n_prompt, *n_gen):,} tokens (plus 64) do not fit the model's "
                          f"context of {model_ctx:,} tokens")
    m = load_model(path, device=device, threads=threads, n_ctx=n_ctx, console=err,
                   vram=vram, cpu_only=cpu_only, overrides=overrides, cuda_graphs=cuda_graphs,
                   expert_cache=expert_cache, pcie_share=pcie_share, split_ffn=split_ffn)
    rows = []
    for n in n_prompt:
        if n > 0:
            with err.status(f"pp{n}…"):
                rows.append(bench_prompt(m, n, reps))
    for n in n_gen:
        if n > 0:
            with err.status(f"tg{n}…"):
                rows.append(bench_generate(m, n, reps))
    for d in draft:
        if not m.has_mtp and d.strip() != "0":
            raise HybridError("this model has no MTP head: drop -d/--draft")
        for n in n_gen:
            if n > 0:
                with err.status(f"tg{n} draft={d}…"):
                    rows.append(bench_draft(m, n, d, reps))
    size_gib = m.file.path.stat().st_size / 2**30
    records = [{"model": m.path.name, "arch": m.config.arch, "size_gib": round(size_gib, 3),
                "backend": m.device, "threads": m.threads, "test": r.test,
                "t_s": round(r.mean, 3), "t_s_stdev": round(r.stdev, 3),
                "tokens_per_step": None if r.tokens_per_step is None else round(r.tokens_per_step, 3)}
               for r in rows]
    if output == "json":
        sys.stdout.write(json.dumps(records) + "\n")
    elif output == "csv":
        buf = io.StringIO()
        w = csv.DictWriter(buf, fieldnames=list(records[0]) if records else ["test"])
        w.writeheader()
        w.writerows(records)
        sys.stdout.write(buf.getvalue())
    else:
        print("| model | arch | size | backend | threads | test | t/s | tok/step |")
        print("| --- | --- | ---: | --- | ---: | --- | ---: | ---: |")
        for r in records:
            tps = "" if r["tokens_per_step"] is None else f"{r['tokens_per_step']:.2f}"
            print(f"| {r['model']} | {r['arch']} | {r['size_gib']:.2f} GiB | {r['backend']} | {r['threads']} | "
                  f"{r['test']} | {r['t_s']:.2f} ± {r['t_s_stdev']:.2f} | {tps} |")
