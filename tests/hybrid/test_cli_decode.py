"""`hybrid decode` and `hybrid bench` end to end on the bundled trained model."""
import json
import subprocess
import sys

import numpy as np
import pytest

import hybrid
from hybrid.errors import HybridError


def run_cli(*args, timeout=600):
    return subprocess.run([sys.executable, "-c", "from hybrid.cli import main; main()", *args],
                          capture_output=True, text=True, timeout=timeout,
                          stdin=subprocess.DEVNULL)   # an inherited pipe would be read as the prompt


@pytest.fixture(scope="module")
def model():
    return hybrid.load(threads=2)


def test_decode_json_greedy_matches_teacher_forced_argmax(model):
    r = run_cli("decode", "-p", "def add(a, b):", "-n", "12", "--temp", "0", "--json", "--ignore-eos")
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)          # exactly one JSON object, nothing else on stdout
    for key in ("tokens", "text", "prompt_tokens", "prefill_tps", "decode_tps", "generated_tokens", "stop_reason"):
        assert key in out
    assert len(out["tokens"]) == 12 == out["generated_tokens"]
    assert out["text"] == model.tokenizer.decode(out["tokens"])
    prompt = model.tokenizer.encode("def add(a, b):")
    assert out["prompt_tokens"] == len(prompt)
    # each greedy token is the argmax of the teacher-forced logits at its position
    logits = model.logits(prompt + out["tokens"][:-1])
    assert list(np.argmax(logits[len(prompt) - 1:], axis=1)) == out["tokens"]


def test_decode_default_runs_bundled_demo():
    r = run_cli("decode", "-n", "4", "--temp", "0")
    assert r.returncode == 0, r.stderr
    assert "def fibonacci(n):" not in r.stderr  # the prompt is not echoed as an error
    assert "t/s" in r.stderr                     # summary goes to stderr when stdout is not a terminal


@pytest.mark.parametrize("args, message", [
    (["decode", "-p", "", "-n", "2"], "prompt is empty"),
    (["decode", "-p", "x " * 50, "-c", "16"], "does not fit the context"),
    (["decode", "/nonexistent/model.gguf", "-p", "hi"], "not found"),
    (["decode", "-p", "a", "-f", "somefile"], "not both"),
    (["decode", "-p", "a", "-n", "-3"], "-n must be"),
    (["bench", "-o", "xml"], "unknown output format"),
])
def test_bad_input_gives_clear_message(args, message):
    r = run_cli(*args)
    assert r.returncode == 1
    assert message in r.stderr
    assert "Traceback" not in r.stderr


@pytest.mark.parametrize("args", [("--temp", "warm"), ("--pcie-share", "1.5"), ("--pcie-share", "-0.1")])
def test_bad_flag_is_a_usage_error(args):
    r = run_cli("decode", *args)
    assert r.returncode == 2
    assert "Traceback" not in r.stderr


def test_library_refuses_a_pcie_share_outside_zero_to_one():
    with pytest.raises(HybridError, match="from 0 to 1"):
        hybrid.load(device="cpu", pcie_share=2.0)


def test_bench_json_rows():
    r = run_cli("bench", "-p", "16", "-n", "4", "-r", "2", "-o", "json")
    assert r.returncode == 0, r.stderr
    rows = json.loads(r.stdout)
    assert [row["test"] for row in rows] == ["pp16", "tg4"]
    assert all(row["t_s"] > 0 for row in rows)


def test_decode_json_draft_stats_and_lossless():
    plain = run_cli("decode", "-p", "def add(a, b):", "-n", "24", "--temp", "0", "--json", "--ignore-eos",
                    "--draft", "0")
    drafted = run_cli("decode", "-p", "def add(a, b):", "-n", "24", "--temp", "0", "--json", "--ignore-eos",
                      "--spec-draft-n-max", "3")
    assert plain.returncode == 0 and drafted.returncode == 0, plain.stderr + drafted.stderr
    p, d = json.loads(plain.stdout), json.loads(drafted.stdout)
    assert "draft" not in p
    assert d["tokens"] == p["tokens"]               # greedy drafting is lossless
    stats = d["draft"]
    for key in ("depth", "steps", "drafted", "accepted", "acceptance", "tokens_per_step"):
        assert key in stats
    assert stats["depth"] == 3
    assert 0 < stats["accepted"] <= stats["drafted"] <= 3 * stats["steps"]
    assert stats["acceptance"] == pytest.approx(stats["accepted"] / stats["drafted"])
    # every verify pass emits its accepted drafts plus one token; the first token comes from prefill
    assert 1 + stats["steps"] + stats["accepted"] == len(d["tokens"])
    assert stats["tokens_per_step"] == pytest.approx((stats["steps"] + stats["accepted"]) / stats["steps"])


def test_decode_rejects_bad_draft_depth():
    r = run_cli("decode", "-p", "x", "--draft", "lots")
    assert r.returncode == 1 and "draft depth" in r.stderr


def test_bench_draft_row():
    r = run_cli("bench", "-p", "0", "-n", "4", "-r", "1", "--draft", "2", "-o", "json")
    assert r.returncode == 0, r.stderr
    rows = json.loads(r.stdout)
    assert [row["test"] for row in rows] == ["tg4", "tg4 draft=2"]
    assert rows[1]["t_s"] > 0 and 1 <= rows[1]["tokens_per_step"] <= 3


def test_bench_reads_llama_benchs_options():
    """llama-bench's comma lists, -pg, -d (context depth: it was our draft depth) and its options
    that mean nothing here, as a llama-bench user types them."""
    r = run_cli("bench", "-p", "16,8", "-n", "4", "-pg", "8,4", "-d", "0,16", "-r", "2", "-o", "jsonl",
                "-ngl", "99", "-fa", "1", "-b", "512", "-ctk", "q8_0")
    assert r.returncode == 0, r.stderr
    rows = [json.loads(line) for line in r.stdout.splitlines()]
    assert [row["test"] for row in rows] == ["pp16", "pp8", "tg4", "pp8+tg4",
                                             "pp16@d16", "pp8@d16", "tg4@d16", "pp8+tg4@d16"]
    assert all(row["t_s"] > 0 for row in rows)
    for flag in ("-fa", "-b", "-ctk"):
        assert f"{flag} is ignored" in r.stderr


@pytest.mark.parametrize("args, message", [
    (["-d", "auto"], "--draft"),                     # -d was the draft depth; now llama-bench's context depth
    (["-p", "-5"], "≥ 0"),
    (["-pg", "512"], "a prompt and a generation length"),
    (["-t", "8,16"], "one value a run"),
    (["-ngl", "0,99"], "one value a run"),
])
def test_bench_refuses_what_it_cannot_run(args, message):
    r = run_cli("bench", *args)
    assert r.returncode == 1 and message in r.stderr and "Traceback" not in r.stderr, r.stderr


def test_bench_depth_and_pg_time_what_they_name():
    """pp8@d16 times 8 tokens after 16 of untimed context; pp8+tg4 times a prefill and 4 steps."""
    from hybrid.bench import bench_prompt, bench_prompt_generate
    m = hybrid.load(threads=1)
    calls = []
    forward = m.forward.forward

    def spy(state, ids, **kw):
        calls.append((state.n_past, len(ids)))
        return forward(state, ids, **kw)
    m.forward.forward = spy
    row = bench_prompt(m, 8, 1, depth=16)
    assert row.test == "pp8@d16" and row.n_tokens == 8 and len(row.seconds) == 1
    assert calls[-1] == (16, 8)                     # the timed chunk, after the 16-token context
    calls.clear()
    row = bench_prompt_generate(m, 8, 4, 2)
    assert row.test == "pp8+tg4" and row.n_tokens == 12 and len(row.seconds) == 2
    assert calls[-5:] == [(0, 8), (8, 1), (9, 1), (10, 1), (11, 1)]
