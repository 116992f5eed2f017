"""`hybrid chat` end to end on the bundled model, driven through stdin (one message per line)."""
import os
import re
import subprocess
import sys

import pytest

import hybrid

TURN = re.compile(r"cached (\d+) tokens, prefilled (\d+)")


def run_chat(*args, stdin: str, timeout=600):
    env = {**os.environ, "NUMBA_NUM_THREADS": "1"}
    return subprocess.run([sys.executable, "-c", "from hybrid.cli import main; main()", "chat", *args],
                          input=stdin, capture_output=True, text=True, timeout=timeout, env=env)


def test_two_messages_give_two_replies_and_the_second_reuses_the_first():
    r = run_chat("-n", "6", "--temp", "0", "-t", "1", stdin="def add(a, b):\nnow subtract\n/reset\nhello\n")
    assert r.returncode == 0, r.stderr
    assert "Traceback" not in r.stderr
    turns = [(int(c), int(p)) for c, p in TURN.findall(r.stderr)]
    assert len(turns) == 3 and r.stderr.count("stop: ") == 3             # three replies
    first_prompt = len(hybrid.load(threads=1).session().render("def add(a, b):"))
    assert turns[0] == (0, first_prompt)
    cached, prefilled = turns[1]
    assert cached >= first_prompt and 0 < prefilled       # turn 2 prefills only what is new
    assert turns[2][0] == 0                                # after /reset, everything again
    assert r.stdout.strip()


def test_exit_command_and_empty_input():
    r = run_chat("-n", "2", "-t", "1", stdin="/exit\nnever sent\n")
    assert r.returncode == 0, r.stderr
    assert not TURN.search(r.stderr) and r.stdout.strip() == ""


@pytest.mark.parametrize("args, message", [(["-n", "-3"], "-n must be"), (["-ot", "(=CPU"], "bad regular expression")])
def test_bad_option_gives_a_clear_message(args, message):
    r = run_chat(*args, stdin="hi\n")
    assert r.returncode == 1 and message in r.stderr and "Traceback" not in r.stderr


# --- placement options (--cpu-only, --vram, -ot, --no-cuda-graphs), in process through CliRunner ---

from typer.testing import CliRunner              # noqa: E402

from gpu import available as gpu_available  # noqa: E402
from hybrid.cli import app                        # noqa: E402
from hybrid.errors import HybridError             # noqa: E402


class Loaded(Exception):
    """Raised by the stand-in loader: the options got that far; nothing is loaded."""


def test_placement_options_reach_the_loader(monkeypatch):
    seen = {}

    def fake_load_model(path, **kwargs):
        seen.update(kwargs)
        raise Loaded

    monkeypatch.setattr("hybrid.cli.chat.load_model", fake_load_model)
    r = CliRunner().invoke(app, ["chat", "--cpu-only", "--vram", "2GiB", "-ot", "ffn_=CPU", "-ot", "attn=GPU",
                                 "--no-cuda-graphs"], input="hi\n")
    assert isinstance(r.exception, Loaded), r.output
    assert seen["cpu_only"] is True and seen["vram"] == "2GiB" and seen["cuda_graphs"] is False
    assert list(seen["overrides"]) == ["ffn_=CPU", "attn=GPU"]


def test_cpu_only_chat_replies():
    # -n 8: the reply opens with the model's (empty) <think> block, which goes to stderr, not stdout
    r = CliRunner().invoke(app, ["chat", "--cpu-only", "-ot", "ffn_=CPU", "--no-cuda-graphs", "-n", "8",
                                 "--temp", "0", "-t", "1"], input="def add(a, b):\n")
    assert r.exit_code == 0, r.output
    assert TURN.search(r.stderr) and r.stdout.strip()


def outcome(*args: str):
    """(exit code, HybridError message or None) of one in-process CLI call."""
    r = CliRunner().invoke(app, list(args), input="hi\n")
    if r.exception is not None and not isinstance(r.exception, (HybridError, SystemExit)):
        raise r.exception
    return r.exit_code, str(r.exception) if isinstance(r.exception, HybridError) else None


BAD_PLACEMENT = [
    (["--vram", "lots"], "VRAM budget (--vram)"),
    (["-ot", "(=CPU"], "bad regular expression"),
    (["-ot", "ffn_=TPU"], "-ot"),
    (["--cpu-only", "--device", "cuda"], "contradict"),
]


@pytest.mark.parametrize("args, message", BAD_PLACEMENT)
def test_bad_placement_options_fail_like_decode(args, message):
    code, chat_error = outcome("chat", *args)
    assert code == 1 and message in chat_error
    assert outcome("decode", "-p", "hi", "-n", "1", *args) == (code, chat_error)


@pytest.mark.skipif(gpu_available(), reason="checks the no-GPU behaviour")
@pytest.mark.parametrize("args", [["--vram", "1GiB"], ["--device", "cuda", "--vram", "1GiB"]])
def test_vram_without_gpu_behaves_like_decode(args):
    common = ["-n", "1", "--temp", "0", "-t", "1", *args]
    chat, decode = outcome("chat", *common), outcome("decode", "-p", "hi", *common)
    assert chat == decode
    if "cuda" in args:
        assert chat[0] == 1 and "no CUDA GPU found" in chat[1]
    else:
        assert chat == (0, None)        # auto without a GPU: the budget is moot, the CPU runs it
