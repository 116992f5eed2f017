"""#32: hostile and broken inputs end in one clear line — no traceback, no runaway memory or
CPU, nothing overwritten that isn't ours. One test (or group) per numbered item of the issue;
item 6 (state files) is in test_hostile_state.py."""
from __future__ import annotations

import importlib.util
import math
import os
import shutil
import subprocess
import sys
import tracemalloc
from collections import namedtuple
from pathlib import Path

import pytest
from typer.testing import CliRunner

from hybrid.chat_template import ChatTemplate
from hybrid.cli import app
from hybrid.errors import HybridError, ModelError
from hybrid.model_file import open_model
from hybrid.tokenizer import Tokenizer

ROOT = Path(__file__).resolve().parents[2]


def _fuzz_module():
    spec = importlib.util.spec_from_file_location("fuzz_gguf", ROOT / "tools" / "fuzz_gguf.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


fuzz = _fuzz_module()


@pytest.fixture(scope="module")
def seeds(tmp_path_factory):
    return {s["metadata"]["general.architecture"]: s for s in fuzz.seeds(tmp_path_factory.mktemp("seeds"))}


def variant(seeds, tmp_path, arch="qwen35", drop=(), **changes) -> Path:
    """The tiny synthetic model of `arch` with metadata keys changed ('{arch}.' may be written '@.')."""
    s = seeds[arch]
    meta = dict(s["metadata"])
    for k in drop:
        meta.pop(k.replace("@.", f"{arch}."), None)
    meta.update({k.replace("@.", f"{arch}."): v for k, v in changes.items()})
    path = tmp_path / "m.gguf"
    path.write_bytes(fuzz.encode(meta, s["tensors"], s["data"], s["alignment"]))
    return path


def build_all(path: Path) -> None:
    """What `decode --chat` builds from the file before the first forward."""
    with open_model(path) as m:
        tok = Tokenizer.from_metadata(m.metadata)
        text = ChatTemplate.from_metadata(m.metadata).render([{"role": "user", "content": "hi"}])
        tok.encode(text)


def cli(*args: str, input: str | None = None):
    """(exit code, stdout, stderr) of the real entry point in a child, as a user sees it."""
    # this tree first, then the parent's path: dependencies may come from there (the GPU machine's gguf)
    path = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p)
    env = {**os.environ, "PYTHONPATH": path, "NUMBA_NUM_THREADS": "1"}
    r = subprocess.run([sys.executable, "-c", "from hybrid.cli import main; main()", *args], input=input,
                       capture_output=True, text=True, timeout=300, env=env, cwd=ROOT)
    return r.returncode, r.stdout, r.stderr


# --- item 1: make-model replaces only regular files --------------------------------------------

def test_make_model_refuses_links_folders_and_devices(tmp_path):
    link = tmp_path / "null"
    link.symlink_to(os.devnull)
    for target, kind in ((link, "a symbolic link"), (tmp_path, "a folder"), (Path(os.devnull), "a device")):
        code, _, err = cli("make-model", str(target), "--force")
        assert code == 1 and kind in err and "Traceback" not in err, err
    assert link.is_symlink() and os.readlink(link) == os.devnull     # untouched
    assert not (tmp_path / "null.partial").exists()
    # a link at OUT.partial is not written through either
    out = tmp_path / "m.gguf"
    (tmp_path / "m.gguf.partial").symlink_to(tmp_path / "victim")
    code, _, err = cli("make-model", str(out), "--force")
    assert code == 1 and "symbolic link" in err and not (tmp_path / "victim").exists()


def test_make_model_space_and_folder_messages(tmp_path, monkeypatch):
    from hybrid.synth import preset, write_model
    Usage = namedtuple("Usage", "total used free")
    monkeypatch.setattr(shutil, "disk_usage", lambda p: Usage(3 << 20, 2 << 20, 1 << 20))
    with pytest.raises(HybridError, match=r"the model needs 2\.\d\d MiB \(plus .* kept free\), 1\.00 MiB is free"):
        write_model(tmp_path / "m.gguf", preset("tiny", "qwen35"))
    monkeypatch.setattr(shutil, "disk_usage", lambda p: Usage(3 << 20, 0, 3 << 20))
    write_model(tmp_path / "m.gguf", preset("tiny", "qwen35"))      # 2.2 MB fits 3 MiB: no hidden 64 MiB
    afile = tmp_path / "afile"
    afile.write_text("x")
    with pytest.raises(HybridError, match="afile is not a folder"):
        write_model(afile / "m.gguf", preset("tiny", "qwen35"))


# --- item 2: every metadata value type-checked where it is read ---------------------------------

BAD_VALUES = [
    ({"tokenizer.ggml.eos_token_id": math.nan}, "tokenizer.ggml.eos_token_id"),
    ({"tokenizer.ggml.eos_token_id": "7"}, "tokenizer.ggml.eos_token_id"),
    ({"tokenizer.ggml.eos_token_id": math.inf}, "tokenizer.ggml.eos_token_id"),
    ({"tokenizer.ggml.eos_token_id": [1, 2]}, "tokenizer.ggml.eos_token_id"),
    ({"tokenizer.chat_template": 5}, "tokenizer.chat_template"),
    ({"@.attention.recurrent_layers": 1}, "attention.recurrent_layers"),
    ({"@.rope.dimension_sections": 3}, "rope.dimension_sections"),
    ({"tokenizer.ggml.pre": ["qwen35"]}, "tokenizer.ggml.pre"),
    ({"tokenizer.ggml.merges": [1, 2, 3]}, "tokenizer.ggml.merges"),
    ({"tokenizer.ggml.tokens": 5}, "tokenizer.ggml.tokens"),
    ({"tokenizer.ggml.token_type": 1}, "tokenizer.ggml.token_type"),
    ({"@.block_count": math.inf}, "block_count"),
    ({"@.full_attention_interval": "4"}, "full_attention_interval"),
    ({"tokenizer.ggml.add_bos_token": "yes"}, "tokenizer.ggml.add_bos_token"),
    ({"general.name": 7}, "general.name"),
]


@pytest.mark.parametrize("change, key", BAD_VALUES, ids=[k for _, k in BAD_VALUES])
def test_bad_metadata_values_name_their_key(seeds, tmp_path, change, key):
    path = variant(seeds, tmp_path, **change)
    with pytest.raises(ModelError, match=f"'[^']*{key}'"):
        build_all(path)
        from hybrid.summary import summarize        # what `info` reads beyond the config
        with open_model(path) as m:
            summarize(m)


def test_metadata_errors_are_one_line_through_the_cli(seeds, tmp_path):
    path = variant(seeds, tmp_path, **{"@.block_count": math.inf})
    code, _, err = cli("info", str(path))
    assert code == 1 and err.count("\n") == 1 and "block_count" in err and "Traceback" not in err, err


def test_nested_arrays_400_deep(seeds, tmp_path):
    deep = [1]
    for _ in range(400):
        deep = [deep]
    sys.setrecursionlimit(max(sys.getrecursionlimit(), 5000))      # for the test's own encoder
    path = variant(seeds, tmp_path, **{"general.deep": deep})
    sys.setrecursionlimit(1000)
    with pytest.raises(ModelError, match="nests arrays more than 8 deep"):
        open_model(path)


def test_vocab_entries_that_are_not_utf8_keep_their_bytes(seeds, tmp_path):
    s = seeds["qwen35"]
    tokens = list(s["metadata"]["tokenizer.ggml.tokens"])
    types = list(s["metadata"]["tokenizer.ggml.token_type"])
    tokens[-1] = b"<\xff\xfe>".decode("utf-8", "surrogateescape")
    types[-1] = 4                                                   # user-defined: printed as stored
    path = variant(seeds, tmp_path, **{"tokenizer.ggml.tokens": tokens, "tokenizer.ggml.token_type": types})
    with open_model(path) as m:
        tok = Tokenizer.from_metadata(m.metadata)
    assert tok.token_bytes(len(tokens) - 1) == b"<\xff\xfe>"
    assert tok.decode(tok.encode("hello")) == "hello"


def test_a_vocab_entry_a_merge_needs_can_be_missing(seeds, tmp_path):
    """Emptying a token that merges produce made the tokenizers library panic (a Rust
    PanicException, which is no Exception): found by tools/fuzz_gguf.py."""
    tokens = list(seeds["qwen35"]["metadata"]["tokenizer.ggml.tokens"])
    tokens[287] = ""
    build_all(variant(seeds, tmp_path, **{"tokenizer.ggml.tokens": tokens}))


# --- item 3: counts bounded before allocating ---------------------------------------------------

def test_huge_block_count_fails_before_building_layer_lists(seeds, tmp_path):
    path = variant(seeds, tmp_path, drop=["@.attention.recurrent_layers"], **{"@.block_count": 10**6})
    tracemalloc.start()
    try:
        with pytest.raises(ModelError, match="block_count"):
            open_model(path)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 64 << 20, f"{peak / 2**20:.0f} MiB allocated to refuse the file"
    path = variant(seeds, tmp_path, drop=["@.attention.recurrent_layers"], **{"@.block_count": 500})
    with pytest.raises(ModelError, match="block_count' is 500 but the file holds only"):
        open_model(path)


# --- item 4: chat templates render on a budget ------------------------------------------------

def test_nested_range_template_stops_with_a_clear_message(monkeypatch):
    import hybrid.chat_template as ct
    monkeypatch.setattr(ct, "MAX_RENDER_STEPS", 200_000)    # the same rule, reached sooner
    t = ChatTemplate("{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}")
    with pytest.raises(HybridError, match="rendering budget"):
        t.render([{"role": "user", "content": "hi"}])


@pytest.mark.parametrize("source", [
    "{% set ns = namespace(s='ab') %}{% for i in range(64) %}{% set ns.s = ns.s ~ ns.s %}{% endfor %}{{ ns.s }}",
    "{{ 'x' * 1000000000 }}",
    "{{ 'x'.center(1000000000) }}",
    "{% for a in messages[0].content %}{% for b in messages[0].content %}{% for c in messages[0].content %}"
    "{% for d in messages[0].content %}{% endfor %}{% endfor %}{% endfor %}{% endfor %}",
])
def test_templates_that_grow_without_bound_are_stopped(monkeypatch, source):
    import hybrid.chat_template as ct
    monkeypatch.setattr(ct, "MAX_RENDER_SECONDS", 1.0)
    with pytest.raises(HybridError, match="rendering budget"):
        ChatTemplate(source).render([{"role": "user", "content": "x" * 300}])


def test_the_budget_leaves_real_templates_alone():
    from hybrid.synth.vocab import CHATML_TEMPLATE
    messages = [{"role": "user" if i % 2 == 0 else "assistant", "content": "word " * 200} for i in range(200)]
    assert ChatTemplate(CHATML_TEMPLATE).render(messages).count("<|im_start|>") == 201


# --- item 5: file text reaches the terminal as escaped text -------------------------------------

def test_markup_in_the_model_name_is_printed_as_text(seeds, tmp_path):
    path = variant(seeds, tmp_path, **{"general.name": "oops [/bold] x [link=file:///etc]y[/link]\x1b[2J"})
    code, out, err = cli("info", str(path))
    assert code == 0, err
    assert "oops [/bold] x [link=file:///etc]y[/link]\\x1b[2J" in out and "\x1b[2J" not in out


def test_escape_codes_and_huge_keys_never_reach_the_terminal(seeds, tmp_path):
    path = variant(seeds, tmp_path, **{"general.architecture": "x\x1b]0;pwned\x07\x1b[2J"})
    code, _, err = cli("info", str(path))
    assert code == 1 and "\x1b" not in err and "\\x1b]0;pwned" in err, err
    s = seeds["qwen35"]
    meta = {("\x00" * 40000): 5, **s["metadata"]}
    meta.pop("qwen35.block_count")
    path.write_bytes(fuzz.encode(meta, s["tensors"], s["data"], s["alignment"]))
    code, _, err = cli("info", str(path))
    assert code == 1 and err.count("\n") == 1 and len(err) < 2100 and "\x00" not in err, err[:300]


def test_generated_text_on_a_terminal_shows_escape_codes_escaped():
    from hybrid.cli.display import visible
    assert visible("a\x1b[2Jb\nc\td\x00") == "a\\x1b[2Jb\nc\td\\x00"
    assert visible("plain text\n") == "plain text\n"


def test_safe_text_escapes_and_cuts():
    from hybrid.metadata import safe_text
    assert safe_text("a\x1b[2Jb\x00\udcff") == "a\\x1b[2Jb\\x00\\udcff"
    assert safe_text("é ü 中") == "é ü 中"
    cut = safe_text("y" * 40000)
    assert len(cut) < 200 and cut.endswith("…(40,000 characters)")


# --- item 7: CLI options checked before loading; chat goes on after a bad line ------------------

class Loaded(Exception):
    pass


@pytest.mark.parametrize("args, message", [
    (["decode", "-p", "x", "--top-p", "2"], "top_p must be in"),
    (["decode", "-p", "x", "--min-p", "5"], "min_p must be in"),
    (["decode", "-p", "x", "--repeat-penalty", "0"], "repeat_penalty must be > 0"),
    (["chat", "--top-p", "2"], "top_p must be in"),
    (["decode", "-p", "x", "--draft", "-3"], "draft depth"),
])
def test_sampling_options_fail_before_the_model_loads(monkeypatch, args, message):
    def never(*a, **k):
        raise Loaded
    monkeypatch.setattr("hybrid.cli.decode.load_model", never)
    monkeypatch.setattr("hybrid.cli.chat.load_model", never)
    r = CliRunner().invoke(app, args, input="hi\n")
    assert isinstance(r.exception, HybridError) and message in str(r.exception), r.output


@pytest.mark.parametrize("args", [["decode", "-p", "x", "--seed", "-7"],
                                  ["decode", "-p", "x", "--spec-draft-p-min", "7"], ["bench", "-r", "x"]])
def test_out_of_range_options_are_usage_errors(args):
    r = CliRunner().invoke(app, args)
    assert r.exit_code == 2, r.output


def test_bench_sizes_are_checked_against_the_model_context(monkeypatch):
    monkeypatch.setattr("hybrid.cli.bench.load_model", lambda *a, **k: (_ for _ in ()).throw(Loaded()))
    r = CliRunner().invoke(app, ["bench", "-p", "100000"])
    assert isinstance(r.exception, HybridError) and "do not fit the model's context" in str(r.exception)
    r = CliRunner().invoke(app, ["bench", "-p", "0", "-n", "0"])
    assert isinstance(r.exception, HybridError) and "nothing to time" in str(r.exception)


def test_non_interactive_chat_goes_on_after_an_over_long_line():
    code, out, err = cli("chat", "-n", "2", "--temp", "0", "-t", "1", "-c", "64",
                         input="word " * 200 + "\nhello\n")
    assert "no longer fits the context of 64" in err and "Traceback" not in err, err
    assert err.count("stop: ") == 1          # the second line was still answered
    assert code == 1                          # and the failure shows in the exit status


def test_interrupted_prefill_reports_the_tokens_it_did():
    import numpy as np
    from hybrid.events import Stats
    from hybrid.generate import PREFILL_CHUNK, prefill

    class Forward:
        calls = 0
        min_prompt_rows = 1

        def forward(self, state, chunk, logits):
            Forward.calls += 1
            if Forward.calls == 2:
                raise KeyboardInterrupt
            return np.zeros((1, 4), np.float32), None

    stats = Stats()
    with pytest.raises(KeyboardInterrupt):
        for _ in prefill(Forward(), None, list(range(3 * PREFILL_CHUNK)), stats):
            pass
    assert stats.prompt_tokens == PREFILL_CHUNK and stats.prefill_seconds > 0


# --- the fuzzer, bounded ------------------------------------------------------------------------

def test_fuzzer_finds_no_traceback_crash_hang_or_memory_blowup(tmp_path, monkeypatch):
    monkeypatch.setenv("FUZZ_GGUF_SEEDS", str(tmp_path))
    summary = fuzz.main(["--cases", "150", "--seed", "7", "--time-limit", "10", "--quiet"])
    bad = {k: summary[k] for k in ("bad-message", "traceback", "crash", "hang", "over-memory")}
    assert not any(bad.values()), summary
    assert summary["ok"] + summary["error"] == 150 and summary["ok"] > 0
