"""`hybrid chat` end to end on the bundled model, driven through stdin (one message per line)."""
import os
import re
import subprocess
import sys

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


def test_bad_option_gives_a_clear_message():
    r = run_chat("-n", "-1", stdin="hi\n")
    assert r.returncode == 1 and "-n must be" in r.stderr and "Traceback" not in r.stderr
