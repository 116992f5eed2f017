"""The CLI as a llama.cpp user drives it (issue #33): llama.cpp's spellings, stdout hygiene,
reasoning kept apart, chat commands. Each reproducer of the issue runs the real CLI in a
subprocess on the bundled model."""
import json
import os
import signal
import subprocess
import sys
import time

import pytest

import hybrid
from gpu import available as gpu_available
from hybrid.cli.chat import join_lines
from hybrid.cli.display import status_text, visible, LiveStream
from hybrid.cli.llama_flags import rewrite
from hybrid.errors import HybridError
from hybrid.events import Done, Stats, Token
from hybrid.reasoning import ReasoningTagger, starts_inside

CLI = [sys.executable, "-c", "from hybrid.cli import main; main()"]
ENV = {**os.environ, "NUMBA_NUM_THREADS": "1"}


def run(*args, stdin=None, timeout=600):
    # stdin: text to pipe in; None → /dev/null (an inherited pipe would be read as the prompt)
    return subprocess.run([*CLI, *args], input=stdin, stdin=None if stdin is not None else subprocess.DEVNULL,
                          capture_output=True, text=True, timeout=timeout, env=ENV)


def decode_json(*args, stdin=None):
    r = run("decode", "-n", "4", "--temp", "0", "-t", "1", "--json", *args, stdin=stdin)
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout), r.stderr


@pytest.fixture(scope="module")
def model():
    return hybrid.load(threads=1)


# --- 1. llama.cpp spellings ------------------------------------------------------------------

@pytest.mark.parametrize("flags, note", [
    (["-fa", "on"], "-fa is ignored"),               # was: "cannot read prompt file a"
    (["-fa"], "-fa is ignored"),                     # older llama.cpp: no value
    (["-ctk", "q8_0"], "-ctk is ignored"),           # was: Invalid value for '-c'
    (["-tb", "2"], "-tb is ignored"),                # was: Invalid value for '-t'
    (["--jinja"], "--jinja is ignored"),
    (["-no-cnv"], None),                             # was: Invalid value for '-n'
    (["-sm", "none"], "-sm is ignored"),             # was: Invalid value for '-s' / '--seed'
    (["--no-warmup"], "--no-warmup is ignored"),     # was: No such option
])
def test_llama_flags_without_a_meaning_here_run_with_a_note(flags, note):
    r = run("decode", "-p", "hi", "-n", "2", "--temp", "0", "-t", "1", *flags)
    assert r.returncode == 0, r.stderr
    assert "Invalid value" not in r.stderr and "cannot read" not in r.stderr
    if note:
        assert note in r.stderr


def test_cnv_in_decode_names_the_chat_command():
    r = run("decode", "-cnv", "-p", "hi")             # was: Invalid value for '-c'
    assert r.returncode == 1 and "hybrid chat" in r.stderr


def test_ngl_is_accepted(model):
    r = run("decode", "-ngl", "99", "-p", "hi", "-n", "2", "--temp", "0", "-t", "1")    # was: Invalid value for '-n'
    assert r.returncode == 0, r.stderr
    if not gpu_available():
        assert "no CUDA GPU found: -ngl ignored" in r.stderr


def test_ngl_zero_is_cpu_only():
    from hybrid.cli.common import layer_rules
    assert layer_rules("0", None) == ([], True)
    rules, cpu = layer_rules("2", 1)
    assert not cpu and rules[0].endswith("=CPU") and rules[1].endswith("=GPU")   # -ncmoe's rule wins: first
    import re
    gpu = re.compile(rules[1].rpartition("=")[0])
    assert gpu.search("blk.1.attn_q.weight") and not gpu.search("blk.2.attn_q.weight")
    assert not gpu.search("blk.10.attn_q.weight")
    experts = re.compile(rules[0].rpartition("=")[0])
    assert experts.search("blk.0.ffn_up_exps.weight") and not experts.search("blk.0.ffn_up.weight")
    with pytest.raises(HybridError):
        layer_rules("many", None)


def test_sys_is_a_system_message_in_the_chat_template(model):
    out, _ = decode_json("-sys", "be brief", "-p", "hi")       # was: No such option: -s
    expected = model.encode_prompt("hi", chat=True, system="be brief")
    assert out["prompt_tokens"] == len(expected)
    assert out["prompt_tokens"] != len(model.encode_prompt("hi", chat=True))


def test_system_without_chat_is_not_ignored(model):
    out, _ = decode_json("--system", "be brief", "-p", "hi")
    assert out["prompt_tokens"] == len(model.encode_prompt("hi", chat=True, system="be brief"))


def test_s_is_the_seed_in_chat_and_decode():
    a = run("chat", "-s", "7", "-n", "6", "--temp", "1", "--top-k", "0", "--min-p", "0", "-t", "1", "--json",
            stdin="hello\n")
    b = run("chat", "--seed", "7", "-n", "6", "--temp", "1", "--top-k", "0", "--min-p", "0", "-t", "1", "--json",
            stdin="hello\n")
    assert a.returncode == 0 and b.returncode == 0, a.stderr + b.stderr
    assert json.loads(a.stdout)["tokens"] == json.loads(b.stdout)["tokens"]
    assert json.loads(a.stdout)["prompt_tokens"] == json.loads(b.stdout)["prompt_tokens"]   # -s is not a system message


def test_s_with_text_points_to_system():
    r = run("chat", "-s", "You are terse.", stdin="hi\n")
    assert r.returncode == 1 and "-sys" in r.stderr and "seed" in r.stderr


def test_temperature_is_temp():
    a, _ = decode_json("-p", "def f(x):", "--temperature", "0", "--ignore-eos")
    b, _ = decode_json("-p", "def f(x):", "--temp", "0", "--ignore-eos")
    assert a["tokens"] == b["tokens"]


def test_reverse_prompt_stops_like_stop():
    full, _ = decode_json("-p", "def add(a, b):", "-n", "12", "--ignore-eos")
    stop = full["text"][4:7]
    assert stop.strip()
    for flag in ("-r", "--reverse-prompt", "--stop"):
        out, _ = decode_json("-p", "def add(a, b):", "-n", "12", "--ignore-eos", flag, stop)
        assert out["stop_reason"] == "stop_string" and stop not in out["text"]


def test_escape_turns_backslash_n_into_a_newline(model):
    out, _ = decode_json("-e", "-p", "a\\nb")
    assert out["prompt_tokens"] == len(model.tokenizer.encode("a\nb"))
    raw, _ = decode_json("-p", "a\\nb")
    assert raw["prompt_tokens"] == len(model.tokenizer.encode("a\\nb"))


def test_a_prompt_that_looks_like_a_flag_is_left_alone(model):
    out, err = decode_json("-p", "-fa")
    assert out["prompt_tokens"] == len(model.tokenizer.encode("-fa")) and "ignored" not in err


def test_chat_template_file(tmp_path, model):
    t = tmp_path / "t.jinja"
    t.write_text("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
                 "<|im_start|>assistant\nANSWER:", encoding="utf-8")
    out, _ = decode_json("--chat", "--chat-template-file", str(t), "-p", "hi")
    text = "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\nANSWER:"
    assert out["prompt_tokens"] == len(model.tokenizer.encode(text, add_special=False, parse_special=True))
    bad = tmp_path / "bad.jinja"
    bad.write_text("{% for %}", encoding="utf-8")
    r = run("decode", "--chat", "--chat-template-file", str(bad), "-p", "hi")
    assert r.returncode == 1 and "does not parse" in r.stderr


def test_grammar_and_json_schema_flags(tmp_path):
    """llama.cpp's --grammar-file (GBNF), -j and -jf constrain decode's output and each chat reply;
    two at once, a file that is not there, a schema that is not JSON or reasoning on are one-line
    errors."""
    gbnf = tmp_path / "yn.gbnf"
    gbnf.write_text('root ::= ("yes" | "no") "."\n', encoding="utf-8")
    out, _ = decode_json("-p", "Answer:", "--grammar-file", str(gbnf))
    assert out["text"] in ("yes.", "no.") and out["stop_reason"] == "eog"
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"],
              "additionalProperties": False}
    (tmp_path / "s.json").write_text(json.dumps(schema), encoding="utf-8")
    for flags in (["-j", json.dumps(schema)], ["-jf", str(tmp_path / "s.json")]):
        r = run("decode", "-p", "Answer:", "-n", "16", "--temp", "0.9", "-s", "4", "-t", "1", "--json", *flags)
        assert r.returncode == 0, r.stderr
        assert isinstance(json.loads(json.loads(r.stdout)["text"])["ok"], bool)
    r = run("chat", "--json", "-n", "16", "--temp", "0.9", "-s", "4", "-t", "1", "-j", json.dumps(schema),
            stdin="is it done?\nand now?\n")
    assert r.returncode == 0, r.stderr
    replies = [json.loads(line)["text"] for line in r.stdout.splitlines()]
    assert len(replies) == 2 and all(isinstance(json.loads(t)["ok"], bool) for t in replies), replies
    for flags, message in ((["-j", "{}", "--grammar", 'root ::= "a"'], "not several"),
                           (["--chat", "-j", "{}", "--reasoning", "on"], "--reasoning off"),
                           (["-jf", str(tmp_path / "none.json")], "cannot read JSON schema file"),
                           (["-j", "[1"], "is not JSON")):
        r = run("decode", "-p", "x", *flags)
        assert r.returncode == 1 and message in r.stderr and "Traceback" not in r.stderr, r.stderr


def test_version_and_h():
    r = run("--version")
    assert r.returncode == 0 and r.stdout.strip() == f"hybrid {hybrid.__version__}"
    for args in (["-h"], ["decode", "-h"], ["chat", "-h"]):
        r = run(*args)
        assert r.returncode == 0 and "Usage" in r.stdout, args


def test_help_reads_at_80_columns():
    """--help in an 80-column terminal: each command listed with its whole first sentence, and an
    option's help on lines of its own (rich's six-column option table left it ~15 characters)."""
    from typer.testing import CliRunner
    from hybrid.cli import app
    runner = CliRunner()
    top = runner.invoke(app, ["--help"], terminal_width=80)
    assert top.exit_code == 0
    listed = top.stdout.split("Commands:")[1].splitlines()
    assert len([line for line in listed if line.strip()]) == len(app.registered_commands)
    assert not any(line.rstrip().endswith("...") for line in listed), listed
    for command in app.registered_commands:
        r = runner.invoke(app, [command.name, "--help"], terminal_width=80)
        assert r.exit_code == 0 and max(len(line) for line in r.stdout.splitlines()) <= 80, command.name
    decode = runner.invoke(app, ["decode", "--help"], terminal_width=80).stdout
    assert "--temp, --temperature <float>   Temperature; 0 = greedy." in decode


def test_rewrite_leaves_other_commands_alone():
    notes = []
    assert rewrite(["bench", "-r", "2"], notes.append) == ["bench", "-r", "2"]      # bench's -r: repetitions
    assert rewrite(["decode", "-ngl", "9", "-r", "x", "--", "-fa"], notes.append) == \
        ["decode", "--n-gpu-layers", "9", "--stop", "x", "--", "-fa"]
    assert notes == []
    assert rewrite(["chat", "--reasoning-budget", "0"], notes.append) == ["chat", "--reasoning", "off"]
    assert rewrite(["chat", "--reasoning-budget=-1"], notes.append) == ["chat", "--reasoning", "auto"]
    assert rewrite(["chat", "--reasoning-budget", "100"], notes.append) == ["chat"] and len(notes) == 1


def test_llama_cpp_drafting_and_device_spellings():
    notes = []
    assert rewrite(["decode", "--draft-max", "3", "--draft-p-min=0.5"], notes.append) == \
        ["decode", "--draft", "3", "--spec-draft-p-min=0.5"]
    assert rewrite(["decode", "--draft-n", "2"], notes.append) == ["decode", "--draft", "2"]
    assert rewrite(["decode", "-dev", "none"], notes.append) == ["decode", "--device", "cpu"]
    assert rewrite(["serve", "--device=CUDA0"], notes.append) == ["serve", "--device", "cuda"]
    assert rewrite(["chat", "--device", "cuda"], notes.append) == ["chat", "--device", "cuda"]
    assert notes == []
    assert rewrite(["decode", "-dev", "CUDA0,CUDA1"], notes.append) == ["decode", "--device", "cuda"]
    assert len(notes) == 1 and "CUDA0" in notes[0]
    with pytest.raises(HybridError, match="CUDA_VISIBLE_DEVICES=1"):
        rewrite(["decode", "-dev", "CUDA1"], notes.append)
    for flag in ("-md", "--model-draft", "--spec-draft-model"):       # was: "-m d", two models
        with pytest.raises(HybridError, match="MTP head"):
            rewrite(["decode", flag, "small.gguf"], notes.append)
    for flags in (["-mg", "1"], ["--numa", "distribute"], ["-co", "on"], ["--color"], ["--log-disable"]):
        notes.clear()
        assert rewrite(["decode", *flags, "-n", "2"], notes.append) == ["decode", "-n", "2"], flags
        assert len(notes) == 1 and "ignored" in notes[0], flags


def test_bench_takes_llama_bench_spellings():
    notes = []
    assert rewrite(["bench", "-m", "x.gguf", "-p", "512", "-fa", "1", "-ub", "512", "-dev", "none", "--progress",
                    "-ngl", "99"], notes.append) == \
        ["bench", "-m", "x.gguf", "-p", "512", "--device", "cpu", "-ngl", "99"]
    assert [n.split()[0] for n in notes] == ["-fa", "-ub", "--progress"]
    assert rewrite(["bench", "-o", "-fa"], notes.append) == ["bench", "-o", "-fa"]     # a value is left alone


def test_cpu_moe_keeps_only_the_routed_experts_in_host_memory():
    from hybrid.cli.llama_flags import CPU_MOE_RULE
    from hybrid.placement import CPU, _forced_side, parse_overrides
    for flag in ("-cmoe", "--cpu-moe"):                 # was: No such option
        assert rewrite(["decode", flag], print) == ["decode", "--override-tensor", CPU_MOE_RULE]
    rule = parse_overrides([CPU_MOE_RULE])
    for name in ("blk.0.ffn_up_exps.weight", "blk.39.ffn_gate_exps.weight", "blk.7.ffn_down_exps.weight"):
        assert _forced_side(name, rule) == CPU, name
    for name in ("blk.0.ffn_up_shexp.weight", "blk.0.ffn_gate_inp.weight", "blk.0.ffn_down.weight",
                 "blk.0.attn_qkv.weight"):
        assert _forced_side(name, rule) is None, name


def test_events_are_exported_from_the_package():
    from hybrid import Done as D, Token as T
    assert D is Done and T is Token


# --- 2. output hygiene -------------------------------------------------------------------------

def test_prompt_from_stdin_with_f_dash_and_piped(model):
    n = len(model.tokenizer.encode("def add(a, b):\n"))
    out, _ = decode_json("-f", "-", stdin="def add(a, b):\n")     # was: cannot read prompt file -
    assert out["prompt_tokens"] == n
    piped, _ = decode_json(stdin="def add(a, b):\n")              # was: the demo prompt ran
    assert piped["prompt_tokens"] == n


def test_no_display_prompt():
    shown = run("decode", "-p", "def add(a, b):", "-n", "3", "--temp", "0", "-t", "1")
    hidden = run("decode", "-p", "def add(a, b):", "-n", "3", "--temp", "0", "-t", "1", "--no-display-prompt")
    assert shown.returncode == hidden.returncode == 0
    assert shown.stdout.startswith("def add(a, b):")
    assert not hidden.stdout.startswith("def add") and shown.stdout.endswith(hidden.stdout)


def test_a_failing_prompt_is_never_echoed():
    r = run("decode", "-p", "x " * 50, "-c", "16")
    assert r.returncode == 1 and "does not fit" in r.stderr
    assert r.stdout == ""


def test_summary_is_one_line_off_a_terminal():
    r = run("decode", "-p", "def add(a, b):", "-n", "3", "--temp", "0", "-t", "1", "--draft", "0")
    lines = [line for line in r.stderr.splitlines() if line.startswith("prompt ")]
    assert len(lines) == 1 and "stop: length" in lines[0] and len(lines[0]) > 80


def test_first_status_line_has_no_rate_from_one_token():
    s = Stats(generated_tokens=1, decode_seconds=0.001, draft={"steps": 0, "acceptance": 0, "tokens_per_step": 0})
    line = status_text(s, None, True).plain
    assert "1 token" in line and "1 tokens" not in line and "accept" not in line and "1,000" not in line
    s2 = Stats(generated_tokens=4, decode_seconds=0.5, draft={"steps": 2, "acceptance": 0.5, "tokens_per_step": 2})
    assert "8.00 t/s" in status_text(s2, None, True).plain and "accept 50%" in status_text(s2, None, True).plain


def test_control_bytes_are_escaped(capsys):
    assert visible("a\x1b[2Jb\rc\x07\n\td") == "a\\x1b[2Jb\\rc\\x07\n\td"
    from rich.console import Console
    events = [Token(1, "ok\x1b[31m"), Done(Stats(stop_reason="length"), "\x00")]
    LiveStream(Console(file=open(os.devnull, "w"))).run(iter(events))
    out = capsys.readouterr().out
    assert "\x1b" not in out and "\x00" not in out and "ok\\x1b[31m\\x00" in out


def test_ctrl_c_exits_130_with_the_summary():
    p = subprocess.Popen([*CLI, "decode", "-p", "def add(a, b):", "-n", "100000", "-c", "4096", "--ignore-eos",
                          "-t", "1", "--draft", "0"], stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True, env=ENV,
                         # a suite started in the background (`cmd &`) inherits SIGINT ignored, and
                         # Python keeps an ignored SIGINT ignored: give the child the terminal's default
                         preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    try:
        p.stdout.read(20)          # generation has started (the prompt and some tokens came)
        time.sleep(0.2)
        p.send_signal(signal.SIGINT)
        out, err = p.communicate(timeout=120)
    finally:
        if p.poll() is None:
            p.kill()
    assert p.returncode == 130, err
    assert "stop: interrupted" in err and "Traceback" not in err


@pytest.mark.skipif(gpu_available(), reason="checks the no-GPU behaviour")
def test_vram_without_a_gpu_says_so():
    r = run("decode", "-p", "hi", "-n", "1", "-t", "1", "--vram", "12GiB")
    assert r.returncode == 0 and "no CUDA GPU found: --vram ignored" in r.stderr
    plan = run("info", "--plan", "--vram", "12GiB")
    assert plan.returncode == 0 and "hypothetical placement plan" in plan.stdout
    assert json.loads(run("info", "--plan", "--vram", "12GiB", "--json").stdout)["plan"]["hypothetical"] is True


# --- 3. reasoning ------------------------------------------------------------------------------

def test_chat_json_keeps_reasoning_out_of_text(model):
    out, _ = decode_json("--chat", "-p", "hi", "-n", "8")       # was: text began with raw <think>
    assert "<think>" not in out["text"] and "</think>" not in out["text"]
    assert out["reasoning"].startswith("<think>")
    assert model.tokenizer.decode(out["tokens"]) == out["reasoning"] + out["text"]


def test_reasoning_off_renders_the_closed_think_block(model):
    off, _ = decode_json("--chat", "--reasoning", "off", "-p", "hi")
    on, _ = decode_json("--chat", "--reasoning", "on", "-p", "hi")
    assert off["prompt_tokens"] == len(model.encode_prompt("hi", chat=True, reasoning=False))
    assert on["prompt_tokens"] == len(model.encode_prompt("hi", chat=True, reasoning=True))
    assert off["prompt_tokens"] > on["prompt_tokens"]
    r = run("decode", "--reasoning", "on", "-p", "hi")
    assert r.returncode == 1 and "--chat" in r.stderr


def test_library_tags_reasoning_events(model):
    events = list(model.generate("hi", chat=True, max_tokens=8, temperature=0, draft=0))
    tokens = [e for e in events if isinstance(e, Token)]
    assert tokens[0].text == "<think>" and tokens[0].reasoning
    close = next(i for i, t in enumerate(tokens) if t.text == "</think>")
    assert all(t.reasoning for t in tokens[:close + 1])
    raw = [e for e in model.generate("<think>", max_tokens=4, temperature=0, draft=0) if isinstance(e, Token)]
    assert not any(t.reasoning for t in raw)                  # a raw prompt is never tagged
    with pytest.raises(HybridError):
        model.generate("hi", reasoning=False)


def test_tagger_rules():
    ev = [Token(1, "plan"), Token(2, "</think>"), Token(3, "\n\n"), Token(4, "Answer"), Token(5, "\n"),
          Done(Stats(), "")]
    tagged = [e.reasoning for e in ReasoningTagger(iter(ev), inside=True)]
    assert tagged == [True, True, True, False, False, False]
    assert starts_inside("<|im_start|>assistant\n<think>\n") and not starts_inside("<think>\n\n</think>\n\n")


# --- 4. chat ------------------------------------------------------------------------------------

def test_chat_refuses_unknown_commands():
    r = run("chat", "-n", "2", "--temp", "0", "-t", "1", stdin="/frobnicate\n")
    assert r.returncode == 1 and "unknown command /frobnicate" in r.stderr
    assert r.stdout == ""                                       # nothing went to the model


def test_chat_save_and_load(tmp_path):
    f = tmp_path / "conv.json"
    r = run("chat", "-n", "3", "--temp", "0", "-t", "1", "--json", stdin=f"hi\n/save {f}\n")
    assert r.returncode == 0, r.stderr
    saved = json.loads(f.read_text(encoding="utf-8"))
    assert [m["role"] for m in saved["messages"]] == ["user", "assistant"]
    fresh = run("chat", "-n", "3", "--temp", "0", "-t", "1", "--json", stdin="again\n")
    loaded = run("chat", "-n", "3", "--temp", "0", "-t", "1", "--json", stdin=f"/load {f}\nagain\n")
    assert loaded.returncode == 0, loaded.stderr
    # the loaded turn's prompt holds the saved conversation before the new message
    assert json.loads(loaded.stdout)["prompt_tokens"] > json.loads(fresh.stdout)["prompt_tokens"]
    bad = run("chat", stdin=f"/load {tmp_path / 'missing.json'}\n")
    assert bad.returncode == 1 and "cannot read" in bad.stderr


def test_chat_json_lines_and_stop():
    r = run("chat", "-n", "4", "--temp", "0", "-t", "1", "--json", "--ignore-eos", stdin="a\nb\n")
    assert r.returncode == 0, r.stderr
    turns = [json.loads(line) for line in r.stdout.splitlines()]
    assert len(turns) == 2 and all(t["generated_tokens"] == 4 for t in turns)


def test_multi_line_input():
    assert list(join_lines(["one\\", "two", "three"])) == ["one\ntwo", "three"]
    assert list(join_lines(['"""', "a", "", "b", '"""', "c"])) == ["a\n\nb", "c"]


# --- 5. samplers exposed -----------------------------------------------------------------------

def test_frequency_penalty_reaches_the_sampler():
    plain, _ = decode_json("-p", "def add(a, b):", "-n", "24", "--ignore-eos")
    penalised, _ = decode_json("-p", "def add(a, b):", "-n", "24", "--ignore-eos", "--frequency-penalty", "100",
                               "--repeat-last-n", "-1")
    assert len(set(plain["tokens"])) < len(plain["tokens"])              # greedy repeats itself here
    assert len(set(penalised["tokens"])) == len(penalised["tokens"])      # a huge penalty forbids repeats


def test_n_probs_and_logit_bias_from_the_cli(model):
    out, _ = decode_json("-p", "def add(a, b):", "--n-probs", "3", "--ignore-eos")
    assert len(out["probs"]) == len(out["tokens"]) == 4
    first = out["probs"][0]
    assert first["id"] == out["tokens"][0] == first["top"][0]["id"]        # greedy: the likeliest
    assert len(first["top"]) == 3 and first["top"][0]["prob"] >= first["top"][1]["prob"]
    banned, _ = decode_json("-p", "def add(a, b):", "--ignore-eos", "-l", f"{out['tokens'][0]}-inf")
    assert banned["tokens"][0] == first["top"][1]["id"]                     # the runner-up, once the best is banned
    r = run("decode", "-p", "hi", "-l", "nonsense")
    assert r.returncode == 1 and "--logit-bias" in r.stderr


def test_terminal_display_dims_reasoning_and_escapes_control_bytes():
    import io
    from rich.console import Console
    buf = io.StringIO()
    console = Console(file=buf, force_terminal=True, width=60, color_system="standard")
    events = [Token(1, "<think>", reasoning=True), Token(2, "hmm", reasoning=True), Token(3, "</think>", reasoning=True),
              Token(4, "Answer\x1b[2J"), Done(Stats(generated_tokens=4, stop_reason="eog"))]
    LiveStream(console).run(iter(events), prompt="Q: ")
    out = buf.getvalue()
    assert "\x1b[2mhmm" in out or "\x1b[2m<think>hmm" in out          # reasoning in dim
    assert "Answer\\x1b[2J" in out and "\x1b[2J" not in out            # the model's escape is shown, not obeyed
    assert "Q: " in out and "stop: eog" in out


def test_nothing_is_echoed_when_generation_fails_before_its_first_event(capsys):
    def failing():
        raise HybridError("the prompt does not fit the context")
        yield
    with pytest.raises(HybridError):
        LiveStream(__import__("rich.console").console.Console(file=open(os.devnull, "w"))).run(failing(), prompt="PROMPT")
    assert "PROMPT" not in capsys.readouterr().out


def test_serve_takes_llama_server_spellings():
    """llama-server's -ngl/-c/-fa/-np/--cache-ram: placement and context as decode takes them, the
    prompt cache's MiB as --cache-mem (-1 no limit), slots and batching ignored with a note."""
    notes = []
    assert rewrite(["serve", "m.gguf", "-ngl", "99", "-c", "16384", "-fa", "on", "-np", "4", "-cb",
                    "--cache-ram", "4096", "--api-key", "-s3cret", "--port", "8081"], notes.append) == \
        ["serve", "m.gguf", "--n-gpu-layers", "99", "-c", "16384", "--cache-mem", "4096MiB",
         "--api-key", "-s3cret", "--port", "8081"]
    assert len(notes) == 3 and all("ignored" in n for n in notes)
    assert rewrite(["serve", "-cram", "-1"], notes.append)[1:] == ["--cache-mem", str(1 << 62)]
    assert rewrite(["serve", "--cache-ram=0"], notes.append)[1:] == ["--cache-mem", "0MiB"]
    for bad in ("x", "-2"):
        with pytest.raises(HybridError, match="MiB"):
            rewrite(["serve", "--cache-ram", bad], notes.append)
    assert rewrite(["bench", "-np", "4"], notes.append) == ["bench", "-np", "4"]     # serve's alone


def test_serve_takes_llama_servers_n_predict_and_notes_its_other_options():
    notes = []
    assert rewrite(["serve", "-n", "256"], notes.append) == ["serve", "--max-tokens", "256"]
    assert rewrite(["serve", "--n-predict=-1"], notes.append) == ["serve", "--max-tokens", str(1 << 62)]
    assert rewrite(["decode", "-n", "256"], notes.append) == ["decode", "-n", "256"]      # decode's own -n
    assert notes == []
    flags = ["--metrics", "--no-webui", "--slots", "-to", "600", "--threads-http", "4", "-kvu",
             "--reasoning-format", "deepseek", "--embeddings"]
    assert rewrite(["serve", *flags, "--port", "8081"], notes.append) == ["serve", "--port", "8081"]
    assert len(notes) == 8 and all("ignored" in n for n in notes)
    for command in ("serve", "decode", "chat"):
        with pytest.raises(HybridError, match="--chat-template-file"):
            rewrite([command, "--chat-template", "chatml"], notes.append)


def test_serve_refuses_a_bad_cache_ram_in_one_line():
    r = run("serve", "--cache-ram", "lots")
    assert r.returncode != 0 and "Traceback" not in r.stderr
    assert "--cache-ram 'lots': give the cache size in MiB" in r.stderr
    h = run("serve", "--help")
    assert h.returncode == 0 and "--n-gpu-layers" in h.stdout and "--n-cpu-moe" in h.stdout


def test_chat_takes_llama_clis_first_message_and_single_turn(model):
    """llama-cli -p TEXT -st: TEXT is the first user message and the chat ends after its reply
    (was: '-s t' read as the seed, -p unknown)."""
    def replies(*flags):
        r = run("chat", "--json", "-n", "3", "--temp", "0", "-t", "1", *flags, stdin="one\ntwo\n")
        assert r.returncode == 0, r.stderr
        return [json.loads(line) for line in r.stdout.splitlines()]
    first = replies("-p", "hello", "-st")
    assert len(first) == 1
    assert first[0]["prompt_tokens"] == len(model.encode_prompt("hello", chat=True))
    assert len(replies("-p", "hello")) == 3          # then the lines of stdin, one message each
    assert len(replies("--single-turn")) == 1        # the first line read, alone
    r = run("chat", "-p", " ", "-st")
    assert r.returncode == 1 and "-p" in r.stderr and "Traceback" not in r.stderr


def test_llama_cli_input_options_are_noted():
    notes = []
    assert rewrite(["chat", "-mli", "--simple-io", "-sp", "-v", "--in-prefix", "X", "-lv", "3", "-n", "2"],
                   notes.append) == ["chat", "-n", "2"]
    assert [n.split()[0] for n in notes] == ["-mli", "--simple-io", "-sp", "-v", "--in-prefix", "-lv"]


@pytest.mark.parametrize("n", ["-1", "-2"])
def test_n_minus_one_and_two_run_to_the_end_of_the_context(n):
    """llama.cpp's -n -1 (its default: no limit) and -2 (until the context is full) were refused
    ('-n must be ≥ 0'); both run until the context ends (or the text, without --ignore-eos)."""
    out, _ = decode_json("-n", n, "-c", "32", "--ignore-eos", "-p", "hi")
    assert out["stop_reason"] == "context" and out["prompt_tokens"] + out["generated_tokens"] == 32


def test_c_zero_is_the_models_own_context():
    """llama.cpp's -c 0 takes the context the model was made for (was: 'context size must be ≥ 1')."""
    import io

    from rich.console import Console

    from hybrid.cli.common import load_model
    m = load_model(None, device="cpu", threads=1, n_ctx=0, console=Console(file=io.StringIO()), quiet=True)
    assert m.n_ctx == m.config.context_length > 4096
