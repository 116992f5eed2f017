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

from ..bench import bench_draft, bench_generate, bench_prompt, bench_prompt_generate
from ..draft_policy import parse_depth
from ..errors import HybridError
from ..model_file import default_model_path, open_model
from . import app
from .common import (CpuOnlyOpt, CudaGraphsOpt, DeviceOpt, ExpertCacheOpt, NGpuLayersOpt, PcieShareOpt, SplitFfnOpt,
                     ModelArg, ModelOpt, NCpuMoeOpt, OverrideTensorOpt, ThreadsOpt, VramOpt, load_model, pick_model)

FORMATS = ("md", "csv", "json", "jsonl")


def counts(values: List[str], flag: str) -> list[int]:
    """Token counts given as llama-bench takes them: repeated, or comma-separated (-p 128,512)."""
    out = []
    for v in values:
        for item in str(v).split(","):
            try:
                n = int(item)
            except ValueError:
                draft = " (drafting is --draft)" if flag == "-d" else ""
                raise HybridError(f"{flag} {v!r}: give token counts, e.g. {flag} 512 or {flag} 128,512{draft}") from None
            if n < 0:
                raise HybridError(f"{flag} {n}: a token count is ≥ 0")
            out.append(n)
    return out


def pairs(values: List[str]) -> list[tuple[int, int]]:
    """-pg PP,TG (repeatable): llama-bench's prompt-then-generation tests."""
    out = []
    for v in values:
        nums = counts([v], "-pg")
        if len(nums) != 2:
            raise HybridError(f"-pg {v!r}: give a prompt and a generation length, e.g. -pg 512,128")
        out.append((nums[0], nums[1]))
    return out


def one_value(value: Optional[str], flag: str) -> Optional[str]:
    """llama-bench sweeps comma lists of some options; a run here loads one placement."""
    if value is not None and "," in str(value):
        raise HybridError(f"{flag} {value}: one value a run here (run `hybrid bench` once per value)")
    return value


def one_count(value: Optional[str], flag: str) -> Optional[int]:
    """`one_value` as a count (None when not given)."""
    return None if one_value(value, flag) is None else counts([value], flag)[0]


@app.command("bench")
def bench(
    model: Optional[Path] = ModelArg,
    model_opt: Optional[Path] = ModelOpt,
    n_prompt: List[str] = typer.Option(["512"], "-p", "--n-prompt", metavar="N[,N…]", help="Prompt lengths to time "
                                       "(repeatable or comma-separated; 0 skips)."),
    n_gen: List[str] = typer.Option(["128"], "-n", "--n-gen", metavar="N[,N…]", help="Generation lengths to time "
                                    "(repeatable or comma-separated; 0 skips)."),
    n_pg: List[str] = typer.Option([], "-pg", metavar="PP,TG", help="PP,TG: a prompt then a generation, timed together "
                                   "(llama-bench's -pg; repeatable)."),
    n_depth: List[str] = typer.Option(["0"], "-d", "--n-depth", metavar="N[,N…]", help="Tokens of context before each "
                                      "test, untimed (llama-bench's -d; repeatable or comma-separated)."),
    draft: List[str] = typer.Option([], "--draft", metavar="N|auto", help="Also time greedy generation with MTP drafting "
                                    "at this depth (repeatable: --draft 1 --draft auto; 0 = plain, from a code prompt)."),
    reps: int = typer.Option(5, "-r", "--repetitions", help="Repetitions of each test."),
    threads: Optional[str] = ThreadsOpt,           # (a str: llama-bench's comma list gets its own message)
    device: str = DeviceOpt,
    vram: Optional[str] = VramOpt,
    cpu_only: bool = CpuOnlyOpt,
    n_gpu_layers: Optional[str] = NGpuLayersOpt,
    n_cpu_moe: Optional[str] = NCpuMoeOpt,
    overrides: List[str] = OverrideTensorOpt,
    cuda_graphs: bool = CudaGraphsOpt,
    expert_cache: bool = ExpertCacheOpt,
    pcie_share: float = PcieShareOpt,
    split_ffn: bool = SplitFfnOpt,
    output: str = typer.Option("md", "-o", "--output", help="Output format: md, csv, json or jsonl."),
) -> None:
    """Measure prompt and generation speed, as llama-bench does.

    Prompt processing (ppN) and token generation (tgN), mean ± stdev over repetitions, with
    llama-bench's -p, -n, -pg, -d, -r, -t, -ngl, -ncmoe and -o.
    """
    if output not in FORMATS:
        raise HybridError(f"unknown output format {output!r}; choose one of {', '.join(FORMATS)}")
    if reps < 1:
        raise HybridError(f"-r must be ≥ 1, got {reps}")
    prompts, gens, both = counts(n_prompt, "-p"), counts(n_gen, "-n"), pairs(n_pg)
    depths = list(dict.fromkeys(counts(n_depth, "-d")))
    threads_n, moe_n = one_count(threads, "-t"), one_count(n_cpu_moe, "-ncmoe")
    err = Console(stderr=True)
    path = pick_model(model, model_opt)
    for d in draft:
        parse_depth(d)                      # reject bad depths before loading anything
    sizes = [*prompts, *gens, *(p + g for p, g in both)]         # each test's tokens
    if not any(n > 0 for n in sizes):
        raise HybridError("nothing to time: give a positive -p, -n or -pg")
    n_ctx = max(depths) + max(sizes) + 64
    # the model's context bounds every test; read it from the header before loading anything
    with open_model(path or default_model_path()) as f:
        model_ctx = f.config.context_length
    if n_ctx > model_ctx:
        raise HybridError(f"-d/-p/-n/-pg need {n_ctx - 64:,} tokens of context (plus 64), which do not fit "
                          f"the model's context of {model_ctx:,} tokens")
    m = load_model(path, device=device, threads=threads_n, n_ctx=n_ctx, console=err,
                   vram=vram, cpu_only=cpu_only, overrides=overrides, cuda_graphs=cuda_graphs,
                   expert_cache=expert_cache, pcie_share=pcie_share, split_ffn=split_ffn,
                   n_gpu_layers=one_value(n_gpu_layers, "-ngl"), n_cpu_moe=moe_n)
    rows = []
    for depth in depths:                    # llama-bench's order: each depth's pp, tg, then pg tests
        at = f" @ d{depth}" if depth else ""
        for n in prompts:
            if n > 0:
                with err.status(f"pp{n}{at}…"):
                    rows.append(bench_prompt(m, n, reps, depth=depth))
        for n in gens:
            if n > 0:
                with err.status(f"tg{n}{at}…"):
                    rows.append(bench_generate(m, n, reps, depth=depth))
        for p, g in both:
            if p + g > 0:
                with err.status(f"pp{p}+tg{g}{at}…"):
                    rows.append(bench_prompt_generate(m, p, g, reps, depth=depth))
    for d in draft:
        if not m.has_mtp and d.strip() != "0":
            raise HybridError("this model has no MTP head: drop --draft")
        for n in gens:
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
    elif output == "jsonl":
        sys.stdout.writelines(json.dumps(r) + "\n" for r in records)
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
