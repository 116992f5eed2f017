#!/usr/bin/env python3
"""hybrid against llama.cpp (and optionally ik_llama.cpp) on the GPU machine, head to head, one table.

    tools/device/vs_llama_cpp.sh build [--ik] [--no-llama]      # llama-bench builds, models, kernel warm-up
    tools/device/vs_llama_cpp.sh warm                           # models, our kernels compiled
    tools/device/vs_llama_cpp.sh bench [--rows a,b] [--reps 2] [--ik] [--json OUT.json]
    tools/device/vs_llama_cpp.sh bench --dry-run                # the commands, nothing run

`build` compiles llama-bench (~7 min on 16 cores; an interrupted build resumes in the next call
while the machine is held), writes the models of the --rows (~35 s and ~54 s) and, with the time
left, warms: loads each model once in hybrid at the rows' call sizes, so its Numba kernels are
compiled into NUMBA_CACHE_DIR (cold, the GPU compiles a matvec per verify width, ~35 s each).
`warm` does the models and that alone. `bench` never compiles llama-bench (an engine not built is
a row saying so); it writes a missing model. The machine keeps /tmp only while it is held (30 s after a call):
chain the calls.

Every engine holds the same weight bytes on the GPU and on the CPU: llama.cpp's placement flags
are derived from OUR planner's plan for each row (`llama_placement`), never written by hand:
* a dense layer whose FFN our plan leaves on the CPU → `-ot 'blk\\.(i|j|…)\\.(ffn_up\\.weight|…)=CPU'`;
* routed experts: llama.cpp keeps whole layers of them (`-ncmoe N`: layers N… on the GPU), ours
  any k experts of every layer (the expert cache): N is the one whose GPU expert bytes come
  nearest ours (the table's note shows both);
* a CPU plan → `-ngl 0`.
llama.cpp does not load the MTP block (ours plans it on the GPU for drafting): the trunk's bytes
are what match.

Rows (`--rows`, comma-separated ids; default all but the per-type ones):
  27b-12g          27B Q4_K_M at --vram 12GiB: pp512, tg64
  27b-ffn-cpu      27B, every dense FFN on the CPU (ours: -ot pinning them): pp512, tg64
  35b-experts-cpu  35B-A3B, every routed expert on the CPU (ours: --no-expert-cache): pp512, tg64
  35b-12g          35B-A3B at --vram 12GiB (ours: expert cache; llama.cpp: -ncmoe from its bytes)
  27b-cpu          27B CPU only (llama.cpp -ngl 0): tg32
  27b-12g-split    27B at 12 GiB with --split-ffn (every FFN layer's first hidden rows on the GPU,
                   computed beside the CPU's rest): pp512, tg64, verify k = 2..5; llama.cpp cuts no
                   FFN, so its flags are the whole-layer plan of the same budget (27b-12g's)
  27b-12g-8k       27B at 12 GiB, tg64 after an 8192-token context (llama-bench -d 8192; ours its
                   own plan for that context, and llama.cpp's -ot derived from it)
  27b-12g-32k      the same after a 32768-token context (-d 32768)
  verify           cost of a k-token pass over one plain step, k = 2..8, 27B at 12 GiB (llama.cpp:
                   a `-p k` batch over its tg per-token time; ours: a k-token verify step,
                   bench_27b.time_verify, over its tg per-token time)
  cpu-types        tg32 CPU only (llama.cpp -ngl 0) for each weight type, a row each (cpu-Q4_0,
                   cpu-IQ2_XXS, …: any of them alone too): the 27B's layers × 8, every matrix in
                   that type; the note gives the weight bytes a token reads and each engine's GB/s,
                   also as a share of the CPU read bandwidth measured in the same call
Engines alternate within a row: llama.cpp, hybrid, [ik_llama.cpp], repeated --reps times; each
figure is the --stat (median or best) of its repetitions. llama-bench runs with `-fa 1` (flash
attention on, as llama.cpp is run on a GPU), `-t THREADS -ngl 99 -r 1`, default batch sizes, load
mode and KV type (f16); ours with the same threads, CUDA graphs and the defaults of `hybrid.load`
(MoE: the expert cache, and the PCIe share of uncached experts the GPU fetches; --pcie-share 0
leaves every uncached expert to the CPU). The MoE rows' routed expert weights live where the row
says on both sides; llama.cpp's prompt batches also copy CPU weights to the GPU (op offload).

On the GPU machine (no network; numpy<2.5 and gguf from wheels on PYTHONPATH): the llama.cpp
tarballs and build_llama_cuda.sh sit in --bench-dir (default .bench, an ignored, carried folder);
builds go to /tmp/llama-cuda and /tmp/ik-llama-cuda, models to --model-dir (default /tmp, kept while the
machine is).
Each step has a timeout; results are written to --json after every row, so a call that runs out
of time still returns the rows it finished.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import re
import selectors
import shlex
import shutil
import signal
import statistics
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from types import SimpleNamespace

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))        # bench_27b, beside this file

import hybrid  # noqa: E402
from bench_27b import time_verify  # noqa: E402
from hybrid.bench import bench_generate, bench_prompt  # noqa: E402
from hybrid.draft_policy import DraftPolicy  # noqa: E402
from hybrid.errors import HybridError  # noqa: E402
from hybrid.model_file import open_model  # noqa: E402
from hybrid.placement import (CPU, GPU, DEFAULT_PCIE_SHARE, check_pcie_share, cpu_plan, layer_of,  # noqa: E402
                              parse_overrides, plan_placement)
from hybrid.synth import plan_model, preset  # noqa: E402
from hybrid.synth.types import synth_layout  # noqa: E402
from hybrid.units import format_size, parse_size  # noqa: E402

# --- what runs ---------------------------------------------------------------------------------

LLAMA_TARBALL = "llama.cpp-0c1e570-src.tar.xz"
IK_TARBALL = "ik_llama.cpp-8337e4c-src.tar.xz"
BUILD_SCRIPT = "build_llama_cuda.sh"
ENGINE_BUILDS = {"llama.cpp": (LLAMA_TARBALL, Path("/tmp/llama-cuda")),
                 "ik_llama.cpp": (IK_TARBALL, Path("/tmp/ik-llama-cuda"))}


@dataclass(frozen=True)
class SynthModel:
    """A synthetic model tools/make_model.py writes (random codes: llama.cpp loads it as the real
    shape). The 27B file in the default folder is bench_27b.sh's too, so either tool writes it once."""
    path: Path
    preset: str
    arch: str
    type: str = "Q4_K_M"
    layers: int | None = None           # the preset's unless set (make-model --layers)
    vocab: int | None = None            # likewise (--vocab)

    def make_args(self) -> list[str]:
        dims = ([] if self.layers is None else ["--layers", str(self.layers)]) + (
            [] if self.vocab is None else ["--vocab", str(self.vocab)])
        return [str(self.path), "--preset", self.preset, "--arch", self.arch, "--type", self.type, *dims,
                "--method", "codes", "--force"]

    def spec(self):
        dims = {k: v for k, v in (("n_layer", self.layers), ("n_vocab", self.vocab)) if v is not None}
        return preset(self.preset, self.arch, **dims)

    def table(self):
        """What the planner reads (config, tensors: name → name/ne/nbytes/role): from the file when
        it is written, else from the same spec (hybrid.synth: the layout make-model writes), so a
        dry run on a machine without the 16 GB files derives the same flags."""
        if self.path.exists():
            with open_model(self.path) as m:
                return SimpleNamespace(config=m.config, tensors=dict(m.tensors))
        spec = self.spec()
        roles = {s.name: s.role for s in synth_layout(spec)}
        return SimpleNamespace(config=spec.config(), tensors={
            t.name: SimpleNamespace(name=t.name, ne=t.ne, nbytes=t.nbytes, role=roles[t.name], type=t.type)
            for t in plan_model(spec, self.type)})


MODEL_DIR = Path("/tmp")


# issue 31: CPU decode per weight type. Each file is the 27B's layers (D 5120, FFN 17408: every
# row length a multiple of 256, as the K and IQ types need), eight of them, and a small vocabulary,
# every matrix in the one type: ~0.3-2.5 GB a token, far past the caches, written in seconds.
CPU_TYPES = ("Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K", "IQ4_NL", "IQ4_XS",
             "IQ3_XXS", "IQ3_S", "IQ2_XXS", "IQ2_XS", "IQ2_S", "IQ1_S", "IQ1_M", "MXFP4")
TYPE_LAYERS, TYPE_VOCAB = 8, 32000


def synth_models(folder: Path) -> dict[str, SynthModel]:
    """The models the rows use, by key, as files in `folder`."""
    return {"27b": SynthModel(folder / "m27b.gguf", "27b", "qwen35"),
            "35b": SynthModel(folder / "m35b-a3b.gguf", "35b-a3b", "qwen35moe"),
            **{f"t-{t}": SynthModel(folder / f"m27b-{TYPE_LAYERS}l-{t}.gguf", "27b", "qwen35", t,
                                    layers=TYPE_LAYERS, vocab=TYPE_VOCAB) for t in CPU_TYPES}}


MODELS = synth_models(MODEL_DIR)       # main() points them at --model-dir

VRAM = "12GiB"
VERIFY_KS = (2, 3, 4, 5, 6, 7, 8)    # issue 35: k = 4 under 1.45× a step, and no cliff up to 8
DEPTH, LONG_DEPTH = 8192, 32768             # issue 35: decode at 8K and 32K ≥ 1.3× llama.cpp
EVERY_DENSE_FFN_ON_CPU = r"\.ffn_(up|gate|down)\.weight$=CPU"


@dataclass(frozen=True)
class Group:
    """One placement of one model: a hybrid worker loaded once, one llama-bench command per rep.
    Its tests: prompt lengths `pp`, a generation of `tg` tokens after `depth` tokens of context,
    and k-token verify passes `verify` (ours; llama.cpp times `-p k` batches)."""
    name: str
    label: str
    model: str                                  # key of MODELS
    device: str = "cuda"                        # hybrid.load's device ("cpu": CPU only)
    vram: str | None = VRAM
    overrides: tuple[str, ...] = ()
    expert_cache: bool = True
    pcie_share: float = DEFAULT_PCIE_SHARE      # hybrid.load's default (--pcie-share sets every row's)
    split_ffn: bool = False                     # hybrid.load's split_ffn (llama.cpp: whole layers, same budget)
    pp: tuple[int, ...] = ()
    tg: int = 0
    depth: int = 0
    verify: tuple[int, ...] = ()

    @property
    def n_ctx(self) -> int:
        """hybrid's context: as `hybrid bench` sizes it (the longest test + 64), plus the depth."""
        return self.depth + max([*self.pp, self.tg, 1]) + 64


ROWS: dict[str, Group] = {g.name: g for g in (
    Group("27b-12g", "27B Q4_K_M @ 12 GiB", "27b", pp=(512,), tg=64),
    Group("27b-ffn-cpu", "27B every FFN on CPU", "27b", overrides=(EVERY_DENSE_FFN_ON_CPU,), pp=(512,), tg=64),
    Group("35b-experts-cpu", "35B-A3B all experts on CPU", "35b", expert_cache=False, pp=(512,), tg=64),
    Group("35b-12g", "35B-A3B @ 12 GiB", "35b", pp=(512,), tg=64),
    Group("27b-cpu", "27B CPU only", "27b", device="cpu", vram=None, tg=32),
    Group("27b-12g-split", "27B @ 12 GiB, FFN split", "27b", split_ffn=True, pp=(512,), tg=64,
          verify=VERIFY_KS[:4]),
    Group("27b-12g-8k", "27B @ 12 GiB, 8K context", "27b", tg=64, depth=DEPTH),
    Group("27b-12g-32k", "27B @ 12 GiB, 32K context", "27b", tg=64, depth=LONG_DEPTH),
)}
ROW_IDS = (*ROWS, "verify")                 # the default rows
TYPE_ROWS: dict[str, Group] = {g.name: g for g in (
    Group(f"cpu-{t}", f"{t}, CPU only", f"t-{t}", device="cpu", vram=None, tg=32) for t in CPU_TYPES)}
ALL_ROW_IDS = (*ROW_IDS, "cpu-types", *TYPE_ROWS)


def select_groups(rows: list[str]) -> list[Group]:
    """The groups that run for the row ids asked for. `verify` joins the 27B 12 GiB group (same
    placement, one load); alone, that group still times tg64, the verify ratio's denominator.
    `cpu-types`: every per-type CPU row."""
    unknown = [r for r in rows if r not in ALL_ROW_IDS]
    if unknown:
        raise HybridError(f"unknown row(s) {', '.join(unknown)}; choose from {', '.join(ALL_ROW_IDS)}")
    groups = [ROWS[r] for r in ROWS if r in rows]
    groups += [g for r, g in TYPE_ROWS.items() if r in rows or "cpu-types" in rows]
    if "verify" in rows:
        base = ROWS["27b-12g"]
        if base in groups:
            groups[groups.index(base)] = replace(base, verify=VERIFY_KS)
        else:
            groups.insert(0, replace(base, pp=(), verify=VERIFY_KS))
    return groups


# --- our plan, and llama.cpp's flags for the same bytes -----------------------------------------

def our_plan(group: Group, model_file):
    """The plan `hybrid.load(path, device, vram=…, overrides=…, n_ctx=…, expert_cache=…)` makes
    (hybrid.api.Model), computed without a GPU: the same planner, budget and inputs (plan_for
    only caps the budget at the GPU's free memory, which a 12 GiB budget on an 80 GB card is under)."""
    c = model_file.config
    ring = DraftPolicy.parse(None, c.n_nextn > 0).ring
    rules = parse_overrides(group.overrides)
    if group.device == "cpu":
        return cpu_plan(model_file, group.n_ctx, ring, rules, "device cpu")
    return plan_placement(model_file, parse_size(group.vram, "VRAM budget"), n_ctx=group.n_ctx, n_ring=ring,
                          overrides=rules, expert_cache=group.expert_cache,
                          pcie_share=check_pcie_share(group.pcie_share), split_ffn=group.split_ffn)


@dataclass
class LlamaPlacement:
    ngl: int                                    # -ngl
    cpu_rules: list[str] = field(default_factory=list)   # REGEX (to the CPU), trunk tensors by name
    ncmoe: int = 0                              # -ncmoe: routed experts of the first N layers on the CPU
    note: str = ""

    def args(self, engine: str = "llama.cpp") -> list[str]:
        """llama-bench arguments. One -ot value holds every rule (a second -ot is a second test
        configuration to llama-bench): llama.cpp separates rules with ';' (',' separates
        configurations), ik_llama.cpp with ','. ik spells -ncmoe --n-cpu-moe."""
        out = ["-ngl", str(self.ngl)]
        if self.cpu_rules:
            sep = "," if engine == "ik_llama.cpp" else ";"
            out += ["-ot", sep.join(f"{r}=CPU" for r in self.cpu_rules)]
        if self.ncmoe:
            out += ["--n-cpu-moe" if engine == "ik_llama.cpp" else "-ncmoe", str(self.ncmoe)]
        return out


def _alternation(items) -> str:
    items = list(items)
    return items[0] if len(items) == 1 else "(" + "|".join(items) + ")"


def llama_placement(plan, model_file) -> LlamaPlacement:
    """llama-bench placement flags that keep the bytes `plan` keeps on each side, for the trunk
    layers llama.cpp loads (not the MTP block: llama-bench skips it)."""
    c = model_file.config
    if plan.device == "cpu":
        return LlamaPlacement(ngl=0, note="CPU only")
    trunk = [t for t in plan.tensors.values() if 0 <= layer_of(t.name) < c.n_layer]
    # non-expert FFN tensors (dense FFN, MoE router + shared expert) on the CPU, by name: rules
    # grouped by the layers they cover, each naming its tensors after 'blk.N.'
    layers_of: dict[str, list[int]] = {}
    for t in trunk:
        if t.group in ("ffn", "router+shared") and t.side == CPU:
            suffix = t.name.split(".", 2)[2]
            layers_of.setdefault(suffix, []).append(layer_of(t.name))
    by_layers: dict[tuple[int, ...], list[str]] = {}
    for suffix, layers in sorted(layers_of.items()):
        by_layers.setdefault(tuple(sorted(layers)), []).append(re.escape(suffix))
    rules = [rf"blk\.{_alternation(map(str, layers))}\.{_alternation(suffixes)}"
             for layers, suffixes in by_layers.items()]
    # routed experts: our GPU share in bytes → whole expert layers on llama.cpp's GPU
    ncmoe, note = 0, ""
    per_layer: dict[int, int] = {}
    for t in trunk:
        if t.group == "experts":
            per_layer[layer_of(t.name)] = per_layer.get(layer_of(t.name), 0) + t.nbytes
    if per_layer:
        ours = (sum(t.nbytes for t in trunk if t.group == "experts" and t.side == GPU)
                + sum(plan.expert_cache.get(i, 0) * b // c.n_expert for i, b in per_layer.items()))
        # -ncmoe N leaves layers N… on the GPU: the N whose bytes come nearest ours
        layers = sorted(per_layer)
        ncmoe = min(range(len(layers) + 1), key=lambda n: (abs(sum(per_layer[i] for i in layers[n:]) - ours), -n))
        theirs = sum(per_layer[i] for i in layers[ncmoe:])
        note = (f"routed experts on the GPU: ours {format_size(ours)}"
                + (f" ({next(iter(plan.expert_cache.values()))} of {c.n_expert} per layer cached)"
                   if plan.expert_cache else "")
                + f", llama.cpp -ncmoe {ncmoe}: {len(layers) - ncmoe} layers = {format_size(theirs)}")
    n_cpu_ffn = len({layer_of(t.name) for t in trunk if t.group == "ffn" and t.side == CPU})
    if n_cpu_ffn:
        note = f"{n_cpu_ffn} of {c.n_layer} FFN layers on the CPU"
    return LlamaPlacement(ngl=99, cpu_rules=rules, ncmoe=ncmoe, note=note)


# --- llama-bench ---------------------------------------------------------------------------------

def llama_command(engine: str, binary: Path, model: Path, group: Group, placement: LlamaPlacement,
                  threads: int) -> list[str]:
    """One llama-bench run, one repetition of every test of `group`."""
    pp = [*group.pp, *group.verify]
    cmd = [str(binary), "-m", str(model), "-t", str(threads), *placement.args(engine), "-fa", "1", "-r", "1"]
    if engine == "ik_llama.cpp":
        cmd += ["-o", "json"]
        if group.depth:        # ik's llama-bench has no -d: -gp D,N times N tokens after a D-token prompt
            cmd += ["-p", ",".join(map(str, pp)) or "0", "-n", "0", "-gp", f"{group.depth},{group.tg}"]
            return cmd
    else:
        cmd += ["-o", "jsonl"]                  # a line per finished test: a killed run keeps them
        if group.depth:
            cmd += ["-d", str(group.depth)]
    cmd += ["-p", ",".join(map(str, pp)) or "0", "-n", str(group.tg)]
    return cmd


def parse_llama_output(engine: str, stdout: str) -> dict[str, list[float]]:
    """Test key → seconds per sample: 'pp512' (the whole batch), 'tg64' / 'tg64@d8192' (all tokens).
    llama.cpp writes JSON lines (-o jsonl), ik_llama.cpp a JSON array; ik's -gp records (prompt and
    generation both set) time the generation only."""
    text = stdout.strip()
    if not text:
        return {}
    if text.startswith("["):
        try:
            records = json.loads(text)
        except json.JSONDecodeError:                     # cut off: the records that closed
            records = [json.loads(m) for m in re.findall(r"\{[^{}]*\}", text)]
    else:
        records = []
        for line in text.splitlines():
            try:
                records.append(json.loads(line))
            except json.JSONDecodeError:         # a log line, or the last line of a killed run
                pass
    out: dict[str, list[float]] = {}
    for r in records:
        seconds = [ns / 1e9 for ns in r.get("samples_ns", [])]
        n_p, n_g, depth = int(r.get("n_prompt", 0)), int(r.get("n_gen", 0)), int(r.get("n_depth", 0))
        if engine == "ik_llama.cpp" and n_p and n_g:
            key = test_key("tg", n_g, n_p)
        elif n_p:
            key = test_key("pp", n_p, depth)
        else:
            key = test_key("tg", n_g, depth)
        out.setdefault(key, []).extend(seconds)
    return out


def test_key(kind: str, n: int, depth: int = 0) -> str:
    return f"{kind}{n}" + (f"@d{depth}" if depth else "")


# --- the hybrid worker ----------------------------------------------------------------------------

def worker_main(spec: dict) -> None:
    """In its own process (a hang is killed by the parent's timeout; its GPU memory goes with it):
    load the model as `spec` says, print one JSON line when ready, then one JSON line of timings
    per 'rep' line read from stdin."""
    # the protocol keeps the real stdout; anything else written there (ours, a library's, C code's)
    # goes to stderr, where the parent's log shows it
    proto = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)
    sys.stdout = sys.stderr
    group = Group(**{k: tuple(v) if isinstance(v, list) else v for k, v in spec["group"].items()})
    model = hybrid.load(spec["path"], device=group.device, threads=spec["threads"], n_ctx=group.n_ctx,
                        vram=group.vram if group.device != "cpu" else None, overrides=group.overrides,
                        expert_cache=group.expert_cache, pcie_share=group.pcie_share, split_ffn=group.split_ffn)
    model.warmup()
    mine = our_plan(group, model.file)
    same = {n: t.side for n, t in model.plan.tensors.items()} == {n: t.side for n, t in mine.tensors.items()}
    same = same and model.plan.expert_cache == mine.expert_cache and model.plan.ffn_split == mine.ffn_split
    print(json.dumps({"ready": True, "device": model.device, "threads": model.threads, "plan_matches": same,
                      "vram_used": model.plan.vram_used if model.plan.budget else 0}), file=proto, flush=True)
    while sys.stdin.readline().strip() == "rep":
        res: dict[str, float] = {}
        for n in group.pp:
            res[test_key("pp", n)] = bench_prompt(model, n, 1).seconds[0]
        if group.tg:
            row = bench_generate(model, group.tg, 1, depth=group.depth)
            res[test_key("tg", group.tg, group.depth)] = row.seconds[0]
            if row.one_offs:
                print(f"warning: one-off work ({row.one_offs}: compilations, allocations, captures) in the timed "
                      f"{row.test} steps", file=sys.stderr)
        for k in group.verify:
            res[f"verify{k}"] = time_verify(model, k, 1)
        print(json.dumps(res), file=proto, flush=True)


class JsonWorker:
    """The parent's handle on a worker process that prints one JSON object when ready and one per
    'rep' line it reads (tools/device/old_new.py's workers too): JSON lines with timeouts; other
    lines it prints are passed to stderr. `popen`: Popen's keyword arguments (env, cwd)."""

    def __init__(self, cmd: list[str], timeout: float, **popen):
        self.proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, **popen)
        self.sel = selectors.DefaultSelector()
        self.sel.register(self.proc.stdout, selectors.EVENT_READ)
        self.ready = self._read(timeout)

    def _read(self, timeout: float) -> dict:
        """The next JSON object the worker prints (other lines are passed to stderr)."""
        end = time.time() + timeout
        while True:
            if not self.sel.select(max(end - time.time(), 0)):
                self.kill()
                raise TimeoutError(f"hybrid worker: no answer in {timeout:.0f} s")
            line = self.proc.stdout.readline()
            if not line:
                code = self.proc.wait()
                raise RuntimeError(f"hybrid worker exited ({code}); its errors are above")
            try:
                got = json.loads(line)
            except json.JSONDecodeError:
                got = None
            if isinstance(got, dict):
                return got
            print(line, end="", file=sys.stderr)

    def rep(self, timeout: float) -> dict[str, float]:
        self.proc.stdin.write("rep\n")
        self.proc.stdin.flush()
        return self._read(timeout)

    def close(self) -> None:
        if self.proc.poll() is None:
            try:
                self.proc.stdin.write("quit\n")
                self.proc.stdin.close()
                self.proc.wait(30)
            except (BrokenPipeError, subprocess.TimeoutExpired):
                self.kill()

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()


class Worker(JsonWorker):
    """A hybrid worker of this script (`worker_main`) for one row group."""

    def __init__(self, group: Group, path: Path, threads: int, timeout: float):
        spec = {"group": asdict(group), "path": str(path), "threads": threads}
        super().__init__([sys.executable, str(Path(__file__).resolve()), "_worker", json.dumps(spec)], timeout)


# --- the run ---------------------------------------------------------------------------------------

def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def run_step(cmd: list[str], timeout: float, dry: bool,
             log_path: Path | None = None) -> subprocess.CompletedProcess | None:
    """Run one command (stdout captured; stderr to log_path or through), None when it timed out.
    It runs in a session of its own, so a timeout ends its children too (cmake's compilers)."""
    log(("would run: " if dry else "run: ") + shlex.join(cmd))
    if dry:
        return subprocess.CompletedProcess(cmd, 0, "", "")
    err = open(log_path, "w") if log_path else None
    try:
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=err, text=True, start_new_session=True)
        try:
            out, _ = proc.communicate(timeout=max(timeout, 1))
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.communicate()
            log(f"timed out after {timeout:.0f} s: {cmd[0]}")
            return None
        return subprocess.CompletedProcess(cmd, proc.returncode, out, "")
    finally:
        if err:
            err.close()


def build(args, engines: list[str], deadline: float, compile_: bool) -> dict[str, Path | str]:
    """llama-bench binaries (skipped when built; compile_=False: only found, as `bench` does, so a
    bench call never spends its minutes compiling), then the synthetic models (skipped when written)."""
    out: dict[str, Path | str] = {}
    bench_dir = Path(args.bench_dir)
    for engine in engines:
        tarball, build_dir = ENGINE_BUILDS[engine]
        binary = build_dir / "bin" / "llama-bench"
        if binary.exists():
            log(f"{engine}: built already ({binary})")
            out[engine] = binary
            continue
        if not compile_:
            out[engine] = binary if args.dry_run else (
                f"not built: run `{Path(__file__).name} build{' --ik' if engine != 'llama.cpp' else ''}` first")
            log(f"{engine}: {out[engine]}")
            continue
        script, src = bench_dir / BUILD_SCRIPT, bench_dir / tarball
        if not args.dry_run and not (script.exists() and src.exists()):
            out[engine] = f"not built: {script} or {src} missing (carry them in --bench-dir)"
            log(f"{engine}: {out[engine]}")
            continue
        log(f"{engine}: building into {build_dir} (~7 min; time nothing meanwhile)")
        t0 = time.time()
        done = run_step(["bash", str(script), str(src), str(build_dir)],
                        min(args.build_timeout, deadline - time.time()), args.dry_run)
        if args.dry_run or binary.exists():
            out[engine] = binary
            log(f"{engine}: built in {time.time() - t0:.0f} s")
        else:
            why = "timed out" if done is None else f"exit {done.returncode}"
            out[engine] = f"build failed ({why}; see {build_dir}/build.log)"
            log(f"{engine}: {out[engine]}")
            tail = build_dir / "build.log"
            if tail.exists():
                print("\n".join(tail.read_text(errors="replace").splitlines()[-15:]), file=sys.stderr)
    for key in args.models:
        m = MODELS[key]
        if m.path.exists() and m.path.stat().st_size > 0:
            log(f"model {key}: {m.path} exists ({format_size(m.path.stat().st_size)})")
            continue
        if deadline - time.time() < args.model_timeout and not args.dry_run:
            log(f"model {key}: no time left to write {m.path} in this call; the next build or bench writes it")
            continue
        log(f"model {key}: writing {m.path}")
        t0 = time.time()
        run_step([sys.executable, str(ROOT / "tools" / "make_model.py"), *m.make_args()],
                 args.model_timeout, args.dry_run)
        log(f"model {key}: {time.time() - t0:.0f} s")
    return out


def warm_kernels(args, groups: list[Group], deadline: float) -> None:
    """Load each model the way the groups do (GPU, or the CPU alone) and run a tiny rep,
    so the Numba kernels they need are compiled into NUMBA_CACHE_DIR before the timed call: a
    fresh machine compiles for minutes. Skipped when the call has too little time left."""
    seen = set()
    for g in groups:
        if (g.model, g.device) in seen:
            continue
        seen.add((g.model, g.device))
        left = deadline - time.time()
        if left < args.warm_min:
            log(f"warm-up of {g.model} ({g.device}) skipped: {left:.0f} s left in this call")
            continue
        # the rows' call sizes (pp512 chunks, one-token steps, the verify widths: the GPU compiles
        # a matvec per width), few tokens
        small = replace(g, tg=2, depth=0, verify=VERIFY_KS if g.device == "cuda" else ())
        if args.dry_run:
            log(f"would warm the kernels: {g.model} on {g.device}")
            continue
        log(f"warming the kernels: {g.model} on {g.device}")
        t0 = time.time()
        try:
            w = Worker(small, MODELS[g.model].path, args.threads, left - 10)
            w.rep(max(deadline - time.time() - 10, 1))
            w.close()
            log(f"warm: {g.model} on {g.device} in {time.time() - t0:.0f} s")
        except (TimeoutError, RuntimeError) as e:
            log(f"warm-up of {g.model} on {g.device}: {e}")


def machine() -> dict:
    gpu = "none"
    if shutil.which("nvidia-smi"):
        q = subprocess.run(["nvidia-smi", "--query-gpu=name,memory.total", "--format=csv,noheader"],
                           capture_output=True, text=True)
        gpu = q.stdout.strip().replace("\n", "; ") or "none"
    cpu = platform.processor()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return {"gpu": gpu, "cpu": cpu, "cpus": os.cpu_count(),
            "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")}


def cpu_read_bandwidth(threads: int) -> float | None:
    """GB/s a Numba parallel sum over 4 GiB reads at `threads` (cpu.bandwidth), in a process of its
    own, so this one never starts a thread pool that could spin beside the engines."""
    code = ("import sys; sys.path.insert(0, sys.argv[2]); import numba; numba.set_num_threads(int(sys.argv[1])); "
            "from cpu.bandwidth import read_bandwidth; print(read_bandwidth(1 << 32))")
    done = run_step([sys.executable, "-c", code, str(threads), str(ROOT)], 300, False)
    try:
        return float(done.stdout.split()[-1])
    except (AttributeError, IndexError, ValueError):
        log("CPU read bandwidth: not measured")
        return None


def stat(samples: list[float] | None, how: str) -> float | None:
    """Seconds: the fastest sample ('best') or the median."""
    if not samples:
        return None
    return min(samples) if how == "best" else statistics.median(samples)


def run_group(group: Group, args, binaries: dict, deadline: float) -> dict:
    """Both (all) engines on one placement, alternating, --reps times. Returns the group's record."""
    path = MODELS[group.model].path
    rec: dict = {"group": asdict(group), "samples": {}, "errors": {}}
    if not path.exists() and not args.dry_run:
        rec["errors"]["all"] = f"{path} missing (`build` writes it)"
        return rec
    table = MODELS[group.model].table()
    plan = our_plan(group, table)
    # llama.cpp cuts no FFN: a split row gives it the whole layers the same budget holds
    place = llama_placement(our_plan(replace(group, split_ffn=False), table), table)
    rec["placement"] = {"args": place.args(), "note": place.note,
                        "ours_gpu_weights": plan.weight_bytes(GPU), "ours_cpu_weights": plan.weight_bytes(CPU),
                        "cpu_bytes_per_token": plan.per_token(CPU)}
    log(f"== {group.label}: ours {group.device}" + (f" --vram {group.vram}" if group.device != "cpu" else "")
        + (f" -ot {' '.join(group.overrides)}" if group.overrides else "")
        + ("" if group.expert_cache else " --no-expert-cache")
        + (f" --pcie-share {group.pcie_share}" if table.config.n_expert else "") + f" (n_ctx {group.n_ctx}); "
        f"llama.cpp {shlex.join(place.args())}" + (f" [{place.note}]" if place.note else ""))
    engines = ["llama.cpp", "hybrid"] + (["ik_llama.cpp"] if args.ik else [])
    for e in engines:
        rec["samples"][e] = {}
    worker = None
    if args.dry_run:
        log(f"would start the hybrid worker: load {path}, warm up, then {args.reps} rep(s) of "
            f"{', '.join(ours_tests(group))}")
    else:
        try:
            worker = Worker(group, path, args.threads, min(args.load_timeout, max(deadline - time.time(), 1)))
            log(f"hybrid loaded: {worker.ready}")
            rec["hybrid_ready"] = worker.ready
            if not worker.ready.get("plan_matches"):      # llama.cpp's flags came from another plan
                rec["placement"]["note"] += " — WARNING: hybrid loaded a plan other than the one the flags came from"
        except (TimeoutError, RuntimeError) as e:
            rec["errors"]["hybrid"] = str(e)
            log(f"hybrid: {e}")
    logs = Path(args.log_dir)
    logs.mkdir(parents=True, exist_ok=True)
    try:
        for rep in range(args.reps):
            for e in engines:
                left = deadline - time.time()
                if left < 5 and not args.dry_run:
                    rec["errors"].setdefault(e, f"out of time at rep {rep + 1}")
                    continue
                if e in rec["errors"] and rep > 0:
                    continue                          # failed once: no more tries this row
                timeout = min(args.step_timeout, left)
                if e == "hybrid":
                    if worker is None:
                        continue
                    log(f"hybrid rep {rep + 1}/{args.reps}")
                    try:
                        res = worker.rep(timeout)
                    except (TimeoutError, RuntimeError) as ex:
                        rec["errors"]["hybrid"] = str(ex)
                        log(f"hybrid: {ex}")
                        worker.close()
                        worker = None
                        continue
                    for k, s in res.items():
                        rec["samples"][e].setdefault(k, []).append(s)
                    log("hybrid: " + ", ".join(f"{k} {s:.3f} s" for k, s in res.items()))
                    continue
                binary = binaries.get(e)
                if not isinstance(binary, Path):
                    rec["errors"][e] = binary or "not built"
                    continue
                cmd = llama_command(e, binary, path, group, place, args.threads)
                log_path = logs / f"{group.name}-{e}-{rep + 1}.log"
                done = run_step(cmd, timeout, args.dry_run, log_path)
                if args.dry_run:
                    continue
                got = parse_llama_output(e, done.stdout) if done is not None else {}
                if done is None or done.returncode != 0 or not got:
                    # llama-bench writes argument errors to stdout, the rest to stderr (the log)
                    tail = log_path.read_text(errors="replace").strip().splitlines()[-3:] if log_path.exists() else []
                    tail += [ln for ln in (done.stdout if done else "").splitlines()
                             if ln.strip() and not ln.lstrip().startswith("{")][-3:]
                    why = "timed out" if done is None else f"exit {done.returncode}"
                    rec["errors"][e] = f"{why}: {' | '.join(tail)[-300:]} (log {log_path})"
                    log(f"{e}: {rec['errors'][e]}")
                for k, s in got.items():
                    rec["samples"][e].setdefault(k, []).extend(s)
                if got:
                    log(f"{e}: " + ", ".join(f"{k} {statistics.fmean(s):.3f} s" for k, s in got.items()))
    finally:
        if worker is not None:
            worker.close()
    return rec


def ours_tests(group: Group) -> list[str]:
    return ([test_key("pp", n) for n in group.pp] + ([test_key("tg", group.tg, group.depth)] if group.tg else [])
            + [f"verify{k}" for k in group.verify])


# --- the table -------------------------------------------------------------------------------------

def table_rows(records: list[dict], engines: list[str], how: str, read_gbs: float | None = None) -> list[list[str]]:
    """Markdown cells: row, test, each engine's t/s (verify rows: the cost ratio), hybrid ÷ each
    other engine, note. A CPU-only row's tg note: the weight bytes a token reads, and what each engine's t/s
    makes of them in GB/s (and of `read_gbs`, the CPU's read bandwidth, when measured)."""
    out = []
    hybrid, others = engines.index("hybrid"), [i for i, e in enumerate(engines) if e != "hybrid"]
    blank = [""] * len(others)
    for rec in records:
        g = rec["group"]
        sm = rec["samples"]

        def rate(e, key, n):
            s = stat(sm.get(e, {}).get(key), how)
            return None if s is None else n / s

        def cell(v, fmt="{:.2f}"):
            return "—" if v is None else fmt.format(v)

        def err(e):
            return rec["errors"].get(e) or rec["errors"].get("all")

        label = g["label"]
        note = rec.get("placement", {}).get("note", "")
        tests = [("pp", n) for n in g["pp"]] + ([("tg", g["tg"])] if g["tg"] else [])
        if g["name"] == "27b-12g" and not g["pp"] and g["verify"]:
            tests = []                                   # verify alone: tg is only its denominator
        for kind, n in tests:
            key = test_key(kind, n, g["depth"] if kind == "tg" else 0)
            vals = [rate(e, key, n) for e in engines]
            ratios = [vals[hybrid] / vals[i] if vals[i] and vals[hybrid] else None for i in others]
            cells = [cell(v) if v is not None else ("failed" if err(e) else "—") for e, v in zip(engines, vals)]
            per_token = rec.get("placement", {}).get("cpu_bytes_per_token")
            if kind == "tg" and g["device"] == "cpu" and per_token:
                gbs = {e: v * per_token / 1e9 for e, v in zip(engines, vals) if v}
                note = f"{per_token / 1e9:.2f} GB a token; GB/s " + ", ".join(
                    f"{e} {r:.1f}" + (f" ({r / read_gbs:.0%} of read)" if read_gbs else "") for e, r in gbs.items())
            out.append([label, key.replace("@d", " @ depth "), *cells, *(cell(r, "{:.2f}×") for r in ratios), note])
        tg_key = test_key("tg", g["tg"], g["depth"])
        for k in g["verify"]:
            ratios = []
            for e in engines:
                tg = stat(sm.get(e, {}).get(tg_key), how)
                step = stat(sm.get(e, {}).get(f"verify{k}" if e == "hybrid" else test_key("pp", k)), how)
                ratios.append(step / (tg / g["tg"]) if tg and step else None)
            out.append([label, f"verify k={k} (÷ one tg step)", *[cell(r, "{:.2f}") for r in ratios], *blank, ""])
        if rec["errors"].get("all"):
            out.append([label, "error", *["" for _ in engines], *blank, rec["errors"]["all"][:200]])
        for e in engines:
            if rec["errors"].get(e):
                out.append([label, f"{e} error", *["" for _ in engines], *blank, rec["errors"][e][:200]])
    return out


def render(records: list[dict], engines: list[str], info: dict, args) -> str:
    head = ["row", "test", *[f"{e} t/s" for e in engines], *[f"hybrid ÷ {e}" for e in engines if e != "hybrid"],
            "placement"]
    read = info.get("cpu_read_gbs")
    lines = [f"**{info['gpu']}**, {info['cpus']} CPUs ({info['cpu']}), {info['date']}; threads {args.threads}, "
             f"{args.reps} rep(s), {args.stat}; llama-bench -fa 1 -ngl 99 and placement flags derived from "
             f"hybrid's plan (-ngl 0 for CPU only; every flag in the JSON)"
             + (f"; CPU read bandwidth {read:.1f} GB/s" if read else ""), "",
             "| " + " | ".join(head) + " |", "|" + "|".join(" --- " for _ in head) + "|"]
    for r in table_rows(records, engines, args.stat, read):
        lines.append("| " + " | ".join(r) + " |")
    return "\n".join(lines)


def main(argv: list[str]) -> int:
    if argv[:1] == ["_worker"]:
        worker_main(json.loads(argv[1]))
        return 0
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    p.add_argument("what", choices=("build", "warm", "bench"),
                   help="build: llama-bench, models, then our kernels as time allows; warm: models and our "
                        "kernels; bench: the rows")
    p.add_argument("--rows", default=",".join(ROW_IDS),
                   help=f"comma-separated, of {','.join(ROW_IDS)}, cpu-types or one cpu-TYPE (default {','.join(ROW_IDS)})")
    p.add_argument("--reps", type=int, default=2)
    p.add_argument("--stat", choices=("median", "best"), default="median")
    p.add_argument("--threads", "-t", type=int, default=os.cpu_count())
    p.add_argument("--pcie-share", type=float, default=None,
                   help="ours: share of a token's uncached experts the GPU fetches over PCIe "
                        f"(MoE rows; default hybrid's, {DEFAULT_PCIE_SHARE}; 0: the CPU runs them all)")
    p.add_argument("--ik", action="store_true", help="also build and run ik_llama.cpp")
    p.add_argument("--no-llama", action="store_true", help="build: skip llama.cpp (e.g. build ik alone)")
    p.add_argument("--bench-dir", default=".bench", help="folder with build_llama_cuda.sh and the tarballs")
    p.add_argument("--json", type=Path, default=None, help="write every sample and the table's figures here")
    p.add_argument("--dry-run", action="store_true", help="print the commands; run nothing")
    p.add_argument("--time-limit", type=float, default=560, help="seconds for the whole call (default 560)")
    p.add_argument("--step-timeout", type=float, default=240, help="seconds for one engine's repetition")
    p.add_argument("--load-timeout", type=float, default=240, help="seconds for hybrid to load and warm up")
    p.add_argument("--build-timeout", type=float, default=560, help="seconds for one llama-bench build")
    p.add_argument("--model-timeout", type=float, default=150, help="seconds for writing one model")
    p.add_argument("--log-dir", default="/tmp/vs_llama_logs")
    p.add_argument("--model-dir", type=Path, default=MODEL_DIR,
                   help=f"folder of the synthetic models, written there when missing (default {MODEL_DIR})")
    p.add_argument("--no-warm", action="store_true", help="build: do not compile our kernels afterwards")
    p.add_argument("--warm-min", type=float, default=90, help="build: seconds a kernel warm-up needs to start")
    args = p.parse_args(argv)
    MODELS.update(synth_models(args.model_dir))
    start = time.time()
    deadline = start + args.time_limit
    rows = [r.strip() for r in args.rows.split(",") if r.strip()]
    groups = select_groups(rows)
    if args.pcie_share is not None:
        groups = [replace(g, pcie_share=check_pcie_share(args.pcie_share)) for g in groups]
    args.models = sorted({g.model for g in groups})
    engines_built = [] if args.what == "warm" else (
        ([] if args.no_llama else ["llama.cpp"]) + (["ik_llama.cpp"] if args.ik else []))
    binaries = build(args, engines_built, deadline, compile_=args.what == "build")
    if args.what in ("build", "warm"):
        if not args.no_warm:
            warm_kernels(args, groups, deadline)
        log(f"{args.what} done in {time.time() - start:.0f} s: {binaries}")
        return 0
    info = machine()
    if any(g.device == "cpu" for g in groups) and not args.dry_run:
        info["cpu_read_gbs"] = cpu_read_bandwidth(args.threads)
    log(f"machine: {info}")
    engines = ["llama.cpp", "hybrid"] + (["ik_llama.cpp"] if args.ik else [])
    records: list[dict] = []
    for group in groups:
        if time.time() > deadline - 30 and not args.dry_run:
            records.append({"group": asdict(group), "samples": {}, "errors": {"all": "skipped: out of time"}})
            continue
        records.append(run_group(group, args, binaries, deadline))
        if args.json:
            _write(args.json, info, args, records, engines)
    table = render(records, engines, info, args)
    print(table, flush=True)
    if args.json:
        _write(args.json, info, args, records, engines)
    log(f"done in {time.time() - start:.0f} s")
    return 0


def _write(path: Path, info: dict, args, records: list[dict], engines: list[str]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"machine": info, "threads": args.threads, "reps": args.reps, "stat": args.stat,
                                "flash_attn": 1, "records": records,
                                "table": table_rows(records, engines, args.stat, info.get("cpu_read_gbs"))},
                               indent=1, default=str))


if __name__ == "__main__":
    try:
        sys.exit(main(sys.argv[1:]))
    except HybridError as e:
        sys.exit(f"error: {e}")
