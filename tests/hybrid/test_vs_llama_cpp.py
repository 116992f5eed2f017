"""tools/device/vs_llama_cpp.py without a GPU: the llama-bench placement derived from our plan
holds the same tensors on the CPU (checked by matching its regexes against every tensor name, as
llama.cpp's loader does with regex_search), llama-bench command lines and output parsing, the
table's arithmetic, the dry run, and the hybrid worker on the bundled model (CPU)."""
from __future__ import annotations

import importlib.util
import json
import re
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

import hybrid
from hybrid.bench import bench_generate
from hybrid.errors import HybridError
from hybrid.placement import CPU, layer_of
from hybrid.synth import preset, write_model

from ..conftest import BUNDLED_MODEL

ROOT = Path(__file__).resolve().parents[2]
TOOL = ROOT / "tools" / "device" / "vs_llama_cpp.py"


def _tool():
    spec = importlib.util.spec_from_file_location("vs_llama_cpp", TOOL)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod           # dataclasses look their module up while the class is made
    spec.loader.exec_module(mod)
    return mod


vs = _tool()
NOWHERE = Path("/nonexistent/model.gguf")


def llama_cpu_tensors(placement, names) -> set[str]:
    """Tensors llama.cpp would put on the CPU: the -ot rules (first match wins, regex_search),
    then -ncmoe N's pattern for layers 0..N-1 (llama.cpp's LLM_FFN_EXPS_REGEX)."""
    rules = [re.compile(r) for r in placement.cpu_rules]
    exps = [re.compile(rf"blk\.{i}\.ffn_(up|down|gate|gate_up)_(ch|)exps") for i in range(placement.ncmoe)]
    return {n for n in names if any(r.search(n) for r in rules + exps)}


def trunk_names(table) -> list[str]:
    """What llama.cpp loads: everything but the MTP block (llama-bench skips it)."""
    return [n for n in table.tensors if layer_of(n) < table.config.n_layer]


@pytest.fixture(scope="module")
def m27b():
    return vs.SynthModel(NOWHERE, "27b", "qwen35").table()


@pytest.fixture(scope="module")
def m35b():
    return vs.SynthModel(NOWHERE, "35b-a3b", "qwen35moe").table()


# --- the placement derivation ---------------------------------------------------------------------

def test_dense_27b_at_12gib_puts_exactly_our_cpu_ffn_tensors_on_llamas_cpu(m27b):
    plan = vs.our_plan(vs.ROWS["27b-12g"], m27b)
    p = vs.llama_placement(plan, m27b)
    names = trunk_names(m27b)
    ours = {n for n in names if plan.side(n) == CPU and ".ffn_" in n}
    assert 0 < len(ours) < len([n for n in names if ".ffn_" in n])        # a real split
    assert llama_cpu_tensors(p, names) == ours
    assert p.ngl == 99 and p.ncmoe == 0
    # what stays on our CPU besides: the embeddings, which llama.cpp keeps on the CPU anyway
    assert {n for n in names if plan.side(n) == CPU} - ours == {"token_embd.weight"}


def test_every_ffn_on_cpu_lists_every_layer(m27b):
    plan = vs.our_plan(vs.ROWS["27b-ffn-cpu"], m27b)
    p = vs.llama_placement(plan, m27b)
    names = trunk_names(m27b)
    ffn = {n for n in names if re.search(r"\.ffn_(up|gate|down)\.weight$", n)}
    assert len(ffn) == 3 * m27b.config.n_layer
    assert llama_cpu_tensors(p, names) == ffn
    assert p.note.startswith(f"{m27b.config.n_layer} of {m27b.config.n_layer}")


def test_8k_context_plan_is_its_own_and_keeps_fewer_ffn_layers_on_the_gpu(m27b):
    short = vs.our_plan(vs.ROWS["27b-12g"], m27b)
    long = vs.our_plan(vs.ROWS["27b-12g-8k"], m27b)
    assert long.n_ctx >= vs.DEPTH + 64
    assert len(long.ffn_layers(CPU)) > len(short.ffn_layers(CPU))       # the 8K KV cache took VRAM
    p = vs.llama_placement(long, m27b)
    names = trunk_names(m27b)
    assert llama_cpu_tensors(p, names) == {n for n in names if long.side(n) == CPU and ".ffn_" in n}


def test_moe_every_expert_on_cpu_is_ncmoe_all_layers(m35b):
    plan = vs.our_plan(vs.ROWS["35b-experts-cpu"], m35b)
    assert not plan.expert_cache
    p = vs.llama_placement(plan, m35b)
    assert p.ncmoe == m35b.config.n_layer and p.cpu_rules == []        # routers + shared experts: GPU
    names = trunk_names(m35b)
    assert llama_cpu_tensors(p, names) == {n for n in names if "_exps." in n}


def test_moe_at_12gib_gives_llama_the_expert_bytes_our_cache_holds(m35b):
    c = m35b.config
    plan = vs.our_plan(vs.ROWS["35b-12g"], m35b)
    k = set(plan.expert_cache.values())
    assert len(k) == 1 and 0 < next(iter(k)) < c.n_expert                # a partial cache
    k = k.pop()
    p = vs.llama_placement(plan, m35b)
    names = trunk_names(m35b)
    exps = [n for n in names if "_exps." in n]
    ours = sum(m35b.tensors[n].nbytes for n in exps) * k // c.n_expert
    on_cpu = llama_cpu_tensors(p, names)
    theirs = sum(m35b.tensors[n].nbytes for n in exps if n not in on_cpu)
    one_layer = max(sum(m35b.tensors[n].nbytes for n in exps if layer_of(n) == i) for i in range(c.n_layer))
    assert abs(theirs - ours) <= one_layer / 2                         # the nearest whole layer
    assert on_cpu <= set(exps)                                         # nothing else leaves the GPU
    assert 0 < p.ncmoe < c.n_layer


def test_cpu_plan_is_ngl_0(m27b):
    p = vs.llama_placement(vs.our_plan(vs.ROWS["27b-cpu"], m27b), m27b)
    assert p.args() == ["-ngl", "0"]


@pytest.mark.parametrize("arch", ["qwen35", "qwen35moe"])
def test_a_written_file_derives_the_same_flags_as_its_spec(tmp_path, arch):
    """The dry run plans from the synth spec; the bench from the written file: the same flags.
    Budgets and rules that split the tiny models: FFN of layers 1 and 3 pinned to the CPU
    (dense), a budget that caches one expert of four per layer beside the prompt streaming slots
    (MoE)."""
    path = tmp_path / "m.gguf"
    write_model(path, preset("tiny", arch), types="Q4_K_M")
    group = (vs.Group("t", "t", "x", vram="1GiB", overrides=(r"blk\.[13]\.ffn_=CPU",)) if arch == "qwen35"
             else vs.Group("t", "t", "x", vram="280192KiB"))
    from_file = vs.SynthModel(path, "tiny", arch).table()
    from_spec = vs.SynthModel(NOWHERE, "tiny", arch).table()
    plans = [vs.our_plan(group, t) for t in (from_file, from_spec)]
    flags = [vs.llama_placement(p, t).args() for p, t in zip(plans, (from_file, from_spec))]
    assert flags[0] == flags[1]
    names = trunk_names(from_file)
    on_cpu = llama_cpu_tensors(vs.llama_placement(plans[0], from_file), names)
    if arch == "qwen35":
        assert on_cpu == {n for n in names if layer_of(n) in (1, 3) and ".ffn_" in n}
    else:
        assert plans[0].streams_experts
        assert 0 < vs.llama_placement(plans[0], from_file).ncmoe < from_file.config.n_layer
        assert on_cpu and all("_exps." in n for n in on_cpu)


def test_a_partial_layer_gets_its_own_rule(m27b):
    group = vs.Group("t", "t", "27b", overrides=(r"blk\.(2|5)\.ffn_down=CPU",), vram="80GiB")
    plan = vs.our_plan(group, m27b)
    p = vs.llama_placement(plan, m27b)
    names = trunk_names(m27b)
    assert llama_cpu_tensors(p, names) == {"blk.2.ffn_down.weight", "blk.5.ffn_down.weight"}


# --- llama-bench command lines and output ---------------------------------------------------------

def test_commands_keep_one_configuration_and_spell_each_engines_flags(m27b):
    plan = vs.our_plan(vs.ROWS["27b-12g"], m27b)
    p = vs.llama_placement(plan, m27b)
    group = vs.select_groups(["27b-12g", "verify"])[0]
    cmd = vs.llama_command("llama.cpp", Path("/b/llama-bench"), Path("/m.gguf"), group, p, 16)
    ot = cmd[cmd.index("-ot") + 1]
    assert "," not in ot              # a ',' would start a second llama-bench configuration
    assert cmd[cmd.index("-p") + 1] == ",".join(map(str, (512, *vs.VERIFY_KS))) and cmd[cmd.index("-n") + 1] == "64"
    assert cmd[cmd.index("-fa") + 1] == "1" and cmd[cmd.index("-t") + 1] == "16"
    assert cmd[cmd.index("-o") + 1] == "jsonl" and cmd[cmd.index("-r") + 1] == "1"
    deep = vs.llama_command("llama.cpp", Path("b"), Path("m"), vs.ROWS["27b-12g-8k"], p, 16)
    assert deep[deep.index("-d") + 1] == "8192" and deep[deep.index("-p") + 1] == "0"
    ik = vs.llama_command("ik_llama.cpp", Path("b"), Path("m"), vs.ROWS["27b-12g-8k"], p, 16)
    assert "-d" not in ik and ik[ik.index("-gp") + 1] == "8192,64" and ik[ik.index("-o") + 1] == "json"
    two = vs.LlamaPlacement(99, [r"blk\.1\.ffn_up\.weight", r"blk\.2\.ffn_up\.weight"], 3)
    assert two.args() == ["-ngl", "99", "-ot", r"blk\.1\.ffn_up\.weight=CPU;blk\.2\.ffn_up\.weight=CPU",
                          "-ncmoe", "3"]
    assert two.args("ik_llama.cpp")[3] == r"blk\.1\.ffn_up\.weight=CPU,blk\.2\.ffn_up\.weight=CPU"
    assert two.args("ik_llama.cpp")[4] == "--n-cpu-moe"


def _record(**kw):
    base = {"n_prompt": 0, "n_gen": 0, "n_depth": 0, "avg_ts": 1.0, "samples_ns": [1_000_000_000]}
    base.update(kw)
    return base


def test_parse_llama_jsonl_and_ik_json():
    out = "\n".join(json.dumps(r) for r in (_record(n_prompt=512, samples_ns=[500_000_000]),
                                             _record(n_gen=64, samples_ns=[6_400_000_000]),
                                             _record(n_gen=64, n_depth=8192, samples_ns=[7_000_000_000])))
    got = vs.parse_llama_output("llama.cpp", "llama log line\n" + out)
    assert got == {"pp512": [0.5], "tg64": [6.4], "tg64@d8192": [7.0]}
    ik = json.dumps([_record(n_prompt=8192, n_gen=64, samples_ns=[8e9]), _record(n_prompt=2, samples_ns=[2e8])])
    assert vs.parse_llama_output("ik_llama.cpp", ik) == {"tg64@d8192": [8.0], "pp2": [0.2]}
    cut = ik[:ik.index("}") + 1]                     # killed mid-array: the finished record counts
    assert vs.parse_llama_output("ik_llama.cpp", cut) == {"tg64@d8192": [8.0]}
    assert vs.parse_llama_output("llama.cpp", "") == {}


def test_table_rates_ratios_and_verify_costs():
    group = vs.select_groups(["27b-12g", "verify"])[0]
    rec = {"group": vs.asdict(group), "errors": {"ik_llama.cpp": "exit 1: unknown model architecture"},
           "placement": {"note": "n"},
           "samples": {"llama.cpp": {"pp512": [1.0, 0.5], "tg64": [6.4, 6.4], **{f"pp{k}": [0.1 * k] * 2
                                                                                for k in vs.VERIFY_KS}},
                       "hybrid": {"pp512": [0.25], "tg64": [3.2, 4.8], **{f"verify{k}": [0.05] for k in vs.VERIFY_KS}}}}
    engines = ["llama.cpp", "hybrid", "ik_llama.cpp"]
    rows = {r[1]: r for r in vs.table_rows([rec], engines, "median")}
    assert rows["pp512"][2:6] == ["682.67", "2048.00", "failed", "3.00×"]     # 512/0.75, 512/0.25
    assert rows["tg64"][2:4] == ["10.00", "16.00"]                             # 64/6.4, 64/4.0
    # llama: 0.1k s ÷ 0.1 s per tg token = k; ours: 0.05 s ÷ (4.0/64) s = 0.8
    assert rows["verify k=3 (÷ one tg step)"][2:4] == ["3.00", "0.80"]
    assert "ik_llama.cpp error" in rows
    best = {r[1]: r for r in vs.table_rows([rec], engines, "best")}
    assert best["pp512"][2] == "1024.00"
    # a column of hybrid ÷ each other engine
    rec = {**rec, "errors": {}, "samples": {**rec["samples"], "ik_llama.cpp": {"pp512": [0.5], "tg64": [8.0]}}}
    rows = {r[1]: r for r in vs.table_rows([rec], engines, "median")}
    assert rows["pp512"][2:7] == ["682.67", "2048.00", "1024.00", "3.00×", "2.00×"]
    assert rows["tg64"][5:7] == ["1.60×", "2.00×"] and len(rows["verify k=3 (÷ one tg step)"]) == 8


def test_select_groups():
    only = vs.select_groups(["verify"])
    assert len(only) == 1 and only[0].pp == () and only[0].tg == 64 and only[0].verify == vs.VERIFY_KS
    assert [g.name for g in vs.select_groups(list(vs.ROW_IDS))] == list(vs.ROWS)
    with pytest.raises(HybridError, match="unknown row"):
        vs.select_groups(["27b"])
    types = vs.select_groups(["cpu-types"])
    assert [g.name for g in types] == [f"cpu-{t}" for t in vs.CPU_TYPES] and "IQ2_XXS" in vs.CPU_TYPES
    assert all(g.device == "cpu" and vs.MODELS[g.model].type == g.name[4:] for g in types)
    assert [g.name for g in vs.select_groups(["27b-cpu", "cpu-IQ1_S"])] == ["27b-cpu", "cpu-IQ1_S"]


def test_a_per_type_model_is_written_as_its_spec_says(tmp_path):
    """make_args (what make_model.py is told) and spec (what a dry run plans from) agree."""
    m = vs.SynthModel(tmp_path / "m.gguf", "tiny", "qwen35", "IQ2_XXS", layers=2, vocab=300)
    r = subprocess.run([sys.executable, str(ROOT / "tools" / "make_model.py"), *m.make_args()],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    from_file = m.table()
    from_spec = vs.SynthModel(NOWHERE, "tiny", "qwen35", "IQ2_XXS", layers=2, vocab=300).table()
    assert from_file.config.n_layer == 2 and from_file.config.n_vocab == 300
    assert {n: (tuple(t.ne), t.nbytes) for n, t in from_file.tensors.items()} == \
        {n: (tuple(t.ne), t.nbytes) for n, t in from_spec.tensors.items()}
    assert from_file.tensors["blk.0.ffn_down.weight"].nbytes == 256 * 512 // 256 * 66     # IQ2_XXS: 66 bytes a block


def test_a_cpu_rows_note_gives_each_engines_read_rate():
    group = vs.TYPE_ROWS["cpu-Q4_0"]
    rec = {"group": vs.asdict(group), "errors": {}, "placement": {"note": "CPU only", "cpu_bytes_per_token": 2e9},
           "samples": {"llama.cpp": {"tg32": [1.0, 1.0]}, "hybrid": {"tg32": [0.8, 0.8]}}}
    row, = vs.table_rows([rec], ["llama.cpp", "hybrid"], "median", read_gbs=100.0)
    assert row[2:5] == ["32.00", "40.00", "1.25×"]
    assert row[5] == "2.00 GB a token; GB/s llama.cpp 64.0 (64% of read), hybrid 80.0 (80% of read)"
    row, = vs.table_rows([rec], ["llama.cpp", "hybrid"], "median")
    assert row[5] == "2.00 GB a token; GB/s llama.cpp 64.0, hybrid 80.0"


def test_dry_run_prints_every_command(tmp_path):
    out = tmp_path / "r.json"
    r = subprocess.run([sys.executable, str(TOOL), "bench", "--dry-run", "--ik", "--reps", "1",
                        "--rows", "27b-12g,35b-12g",
                        "--bench-dir", str(tmp_path), "--model-dir", str(tmp_path), "--json", str(out)],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    runs = [line for line in r.stderr.splitlines() if "would run:" in line]
    assert not any("build_llama_cuda.sh" in line for line in runs)        # bench never compiles
    assert any(f"make_model.py {tmp_path / 'm27b.gguf'} --preset 27b" in line for line in runs)   # missing there
    assert sum("/tmp/llama-cuda/bin/llama-bench" in line and "-ot" in line for line in runs) == 1
    assert sum("ik-llama-cuda/bin/llama-bench" in line and "--n-cpu-moe" in line for line in runs) == 1
    assert "| 27B Q4_K_M @ 12 GiB | pp512 |" in r.stdout
    assert json.loads(out.read_text())["records"][1]["placement"]["args"][:3] == ["-ngl", "99", "-ncmoe"]
    b = subprocess.run([sys.executable, str(TOOL), "build", "--dry-run", "--ik", "--bench-dir", str(tmp_path)],
                       capture_output=True, text=True, timeout=300)
    assert b.returncode == 0, b.stderr
    builds = [line for line in b.stderr.splitlines() if "would run: bash" in line]
    assert len(builds) == 2 and "ik_llama.cpp-8337e4c-src.tar.xz /tmp/ik-llama-cuda" in builds[1]
    assert "would warm the kernels: 27b on cuda" in b.stderr
    t = subprocess.run([sys.executable, str(TOOL), "bench", "--dry-run", "--reps", "1", "--rows", "cpu-IQ2_XXS",
                        "--bench-dir", str(tmp_path), "--model-dir", str(tmp_path)],
                       capture_output=True, text=True, timeout=300)
    assert t.returncode == 0, t.stderr
    runs = [line for line in t.stderr.splitlines() if "would run:" in line]
    assert any("m27b-8l-IQ2_XXS.gguf --preset 27b --arch qwen35 --type IQ2_XXS --layers 8 --vocab 32000" in line
               for line in runs)
    assert sum("llama-bench" in line and "-ngl 0" in line and "-n 32" in line for line in runs) == 1
    assert "| IQ2_XXS, CPU only | tg32 |" in t.stdout


# --- our side ---------------------------------------------------------------------------------------

def test_bench_generate_depth_prefills_that_context_untimed(monkeypatch):
    model = hybrid.load(BUNDLED_MODEL, device="cpu", threads=1, n_ctx=128)
    fed = []
    original = model.forward.forward

    def spy(state, ids, **kw):
        fed.append((state.n_past, len(ids)))
        return original(state, ids, **kw)

    monkeypatch.setattr(model.forward, "forward", spy)
    row = bench_generate(model, 3, 2, depth=40)
    assert row.test == "tg3@d40" and len(row.seconds) == 2
    # per repetition: 40 tokens from position 0 (in chunks), then 1 + 3 one-token steps from 40
    starts = [i for i, (pos, _) in enumerate(fed) if pos == 0 and i >= 2]
    assert len(starts) == 2
    for s in starts:
        chunks, pos = [], 0
        for p, n in fed[s:]:
            if pos >= 40:
                break
            assert p == pos
            chunks.append(n)
            pos += n
        assert sum(chunks) == 40
    assert [n for _, n in fed[-4:]] == [1, 1, 1, 1] and fed[-1][0] == 40 + 3


def test_bench_generate_counts_one_off_work_inside_the_timed_steps(monkeypatch):
    """A steady model reports none; work that lands in the timed loop (here: every second
    one-token step from position 41 on 'compiles') is counted, so a row can say it is no steady
    rate."""
    model = hybrid.load(BUNDLED_MODEL, device="cpu", threads=1, n_ctx=128)
    assert bench_generate(model, 3, 1, depth=40).one_offs == 0
    original, work, calls = model.forward.forward, model.forward.one_off_work, [0]

    def spy(state, ids, **kw):
        if len(ids) == 1 and state.n_past > 40:
            calls[0] += 1
        return original(state, ids, **kw)

    monkeypatch.setattr(model.forward, "forward", spy)
    monkeypatch.setattr(model.forward, "one_off_work", lambda: work() + calls[0] // 2)
    assert bench_generate(model, 4, 2, depth=40).one_offs == 2 * 2


def test_worker_times_every_test_of_its_group_on_the_cpu():
    group = vs.Group("t", "t", "x", device="cpu", vram=None, pp=(8,), tg=3, verify=(2,))
    w = vs.Worker(group, BUNDLED_MODEL, 1, timeout=600)
    try:
        assert w.ready["ready"] and w.ready["device"] == "cpu" and w.ready["plan_matches"]
        reps = [w.rep(timeout=600) for _ in range(2)]
    finally:
        w.close()
    for res in reps:
        assert set(res) == {"pp8", "tg3", "verify2"} and all(np.isfinite(v) and v > 0 for v in res.values())
    assert w.proc.returncode == 0


FAKE_LLAMA_BENCH = r'''#!/usr/bin/env python3
"""A stand-in llama-bench: one JSON line per test of -p/-n/-d, each taking 0.5 s per token."""
import json, sys
a = sys.argv[1:]
opt = lambda f, d: a[a.index(f) + 1] if f in a else d
open(sys.argv[0] + ".calls", "a").write(json.dumps(a) + "\n")
depth = int(opt("-d", "0"))
print("a log line on stdout")
for p in [int(x) for x in opt("-p", "512").split(",") if int(x)]:
    print(json.dumps({"n_prompt": p, "n_gen": 0, "n_depth": depth, "samples_ns": [p * 5e8]}))
n = int(opt("-n", "128"))
if n:
    print(json.dumps({"n_prompt": 0, "n_gen": n, "n_depth": depth, "samples_ns": [n * 5e8]}))
'''


def test_a_row_runs_both_engines_alternately_and_tabulates(tmp_path, monkeypatch):
    fake = tmp_path / "llama-bench"
    fake.write_text(FAKE_LLAMA_BENCH)
    fake.chmod(0o755)
    monkeypatch.setitem(vs.MODELS, "tiny", vs.SynthModel(BUNDLED_MODEL, "tiny", "qwen35"))
    group = vs.Group("t", "tiny on the CPU", "tiny", device="cpu", vram=None, pp=(8,), tg=3, verify=(2,))
    args = SimpleNamespace(dry_run=False, reps=2, ik=False, threads=1, step_timeout=600, load_timeout=600,
                           log_dir=str(tmp_path / "logs"), stat="median")
    rec = vs.run_group(group, args, {"llama.cpp": fake}, time.time() + 1200)
    assert rec["errors"] == {}
    calls = [json.loads(line) for line in (tmp_path / "llama-bench.calls").read_text().splitlines()]
    assert len(calls) == 2 and all(c[c.index("-ngl") + 1] == "0" and c[c.index("-p") + 1] == "8,2" for c in calls)
    assert rec["samples"]["llama.cpp"] == {"pp8": [4.0, 4.0], "pp2": [1.0, 1.0], "tg3": [1.5, 1.5]}
    assert set(rec["samples"]["hybrid"]) == {"pp8", "tg3", "verify2"}
    assert all(len(v) == 2 for v in rec["samples"]["hybrid"].values())
    rows = {r[1]: r for r in vs.table_rows([rec], ["llama.cpp", "hybrid"], "median")}
    assert rows["pp8"][2] == "2.00" and rows["tg3"][2] == "2.00"          # 0.5 s a token
    assert rows["verify k=2 (÷ one tg step)"][2] == "2.00"                # 1.0 s ÷ 0.5 s
    assert float(rows["tg3"][3]) > 2                                       # ours: much faster than 2 t/s


def test_a_failing_engine_is_a_row_of_the_table(tmp_path, monkeypatch):
    bad = tmp_path / "llama-bench"
    bad.write_text("#!/bin/sh\necho 'error: unknown model architecture: qwen35' >&2\nexit 1\n")
    bad.chmod(0o755)
    monkeypatch.setitem(vs.MODELS, "tiny", vs.SynthModel(BUNDLED_MODEL, "tiny", "qwen35"))
    group = vs.Group("t", "tiny", "tiny", device="cpu", vram=None, tg=2)
    args = SimpleNamespace(dry_run=False, reps=2, ik=True, threads=1, step_timeout=600, load_timeout=600,
                           log_dir=str(tmp_path / "logs"), stat="median")
    rec = vs.run_group(group, args, {"llama.cpp": bad, "ik_llama.cpp": "build failed (exit 2)"}, time.time() + 1200)
    assert "unknown model architecture" in rec["errors"]["llama.cpp"]
    assert rec["errors"]["ik_llama.cpp"] == "build failed (exit 2)"
    rows = vs.table_rows([rec], ["llama.cpp", "hybrid", "ik_llama.cpp"], "median")
    assert rows[0][2] == "failed" and rows[0][4] == "failed" and float(rows[0][3]) > 0
    assert [r[1] for r in rows[1:]] == ["llama.cpp error", "ik_llama.cpp error"]


def test_warm_loads_each_model_once_at_the_rows_sizes(monkeypatch, capsys):
    monkeypatch.setitem(vs.MODELS, "tiny", vs.SynthModel(BUNDLED_MODEL, "tiny", "qwen35"))
    groups = [vs.Group("a", "a", "tiny", device="cpu", vram=None, pp=(8,), tg=3),
              vs.Group("b", "b", "tiny", device="cpu", vram=None, tg=5)]
    args = SimpleNamespace(dry_run=False, threads=1, warm_min=1)
    vs.warm_kernels(args, groups, time.time() + 600)
    err = capsys.readouterr().err
    assert err.count("warming the kernels: tiny on cpu") == 1 and "warm: tiny on cpu in" in err
    vs.warm_kernels(args, groups, time.time() + 0.5)          # no time left: skipped, said so
    assert "skipped: 0 s left" in capsys.readouterr().err
