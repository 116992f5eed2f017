"""Time to first token of each turn of a multi-turn chat against `hybrid serve`, with the state
cache on and off: with it, turn N prefills only its new tokens; without it, the whole conversation.
Then the last turn asked again (a regenerated reply) and a new conversation under the same system
prompt: with the cache, each prefills only its last message.

    python tools/serve_ttft.py                      # the bundled tiny model
    python tools/serve_ttft.py model.gguf --turns 8 --system-words 4000 -- --ctx-size 32768

Starts one server per mode on 127.0.0.1 (a free port) and stops it after; arguments after `--` go
to `hybrid serve`. Greedy replies, so both modes must say the same (checked, and reported).
"""
from __future__ import annotations

import argparse
import json
import queue
import subprocess
import sys
import threading
import time

import httpx

QUESTIONS = ["Explain what a hash map is.", "Now show one in Python.", "How does it resize?",
             "What is the cost of a lookup?", "Compare it with a balanced tree.", "Which one should I use for a cache?",
             "Write a short summary.", "Thanks, one last tip?"]


def start(model: str | None, extra: list[str], timeout: float = 900.0):
    cmd = [sys.executable, "-c", "from hybrid.cli import main; main()", "serve", "--port", "0", *extra]
    if model:
        cmd.insert(4, model)
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    ready: queue.Queue = queue.Queue()

    def echo() -> None:
        # the server's log goes on to ours for its whole life: if it dies mid-run, its last words show
        for line in proc.stderr:
            sys.stderr.write(line)
            if "listening on http://" in line:
                ready.put(line.split("listening on ")[1].split()[0])
    threading.Thread(target=echo, daemon=True).start()
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and proc.poll() is None:
        try:
            return proc, ready.get(timeout=1.0)
        except queue.Empty:
            continue
    proc.terminate()
    raise SystemExit(f"hybrid serve did not start (exit code {proc.poll()})")


def turn(url: str, messages: list, max_tokens: int) -> tuple[float, str, int, int]:
    """(seconds to the first streamed chunk, reply content, prompt tokens, cached tokens)."""
    body = {"messages": messages, "max_tokens": max_tokens, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}}
    t0 = time.perf_counter()
    ttft, content, usage = None, [], {}
    with httpx.stream("POST", url + "/v1/chat/completions", json=body, timeout=3600) as r:
        if r.status_code != 200:
            raise SystemExit(f"the server refused a turn ({r.status_code}): {r.read().decode(errors='replace')}")
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            ttft = ttft if ttft is not None else time.perf_counter() - t0
            chunk = json.loads(line[6:])
            if "error" in chunk:
                raise SystemExit(f"server error: {chunk['error']}")
            usage = chunk.get("usage") or usage
            for c in chunk.get("choices", []):
                content.append(c["delta"].get("content") or "")
    return ttft or 0.0, "".join(content), usage.get("prompt_tokens", 0), \
        (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0)


def phases(url: str) -> str:
    """Where the server says the last request's time went (its /stats, once its worker is idle:
    the end snapshot comes after the reply): the wait for the worker (which includes the previous
    reply's end snapshot), restoring a snapshot, the prefill to the last message and its snapshot,
    the first token, the two snapshots taken."""
    deadline = time.perf_counter() + 30
    while True:
        stats = httpx.get(url + "/stats", timeout=30).json()
        if stats.get("pending", 0) == 0 or time.perf_counter() > deadline:
            break
        time.sleep(0.01)
    last = stats.get("last") or {}
    parts = [f"{label} {1e3 * last[key]:.0f}" for label, key in (
        ("queued", "queued_s"), ("restore", "restore_s"), ("to the last message, snapshotted", "boundary_s"),
        ("to first token", "ttft_s"),
        ("prompt snapshot", "prompt_snapshot_s"), ("end snapshot", "end_snapshot_s")) if key in last]
    return f" ({', '.join(parts)} ms)" if parts else ""


def conversation(url: str, turns: int, max_tokens: int, system: str, mode: str | None = None) -> list[tuple]:
    """Each turn's (label, TTFT s, reply, prompt tokens, cached tokens), then the last turn asked
    again (a regenerated reply: "again") and a new conversation under the same system prompt
    ("new"); with `mode`, each is also printed as it comes, so a run cut short (a time limit)
    still shows the turns it finished."""
    system_msg = {"role": "system", "content": system}
    messages = [system_msg]
    out = []

    def ask(label: str, msgs: list) -> str:
        ttft, reply, prompt, cached = turn(url, msgs, max_tokens)
        out.append((label, ttft, reply, prompt, cached))
        if mode:
            print(f"{mode}: {label}, prompt {prompt}, cached {cached}, TTFT {ttft * 1e3:.1f} ms"
                  f"{phases(url)}", flush=True)
        return reply

    for i in range(turns):
        messages.append({"role": "user", "content": QUESTIONS[i % len(QUESTIONS)]})
        messages.append({"role": "assistant", "content": ask(str(i + 1), messages)})
    if turns:
        ask("again", messages[:-1])
        ask("new", [system_msg, {"role": "user", "content": QUESTIONS[turns % len(QUESTIONS)]}])
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("model", nargs="?", help="GGUF file (default: the bundled tiny model)")
    ap.add_argument("--turns", type=int, default=6)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--system-words", type=int, default=600, help="length of a synthetic system prompt")
    # what follows `--` goes to hybrid serve as it is (argparse would give its first word to the
    # optional model argument)
    argv = sys.argv[1:]
    cut = argv.index("--") if "--" in argv else len(argv)
    a = ap.parse_args(argv[:cut])
    a.serve_args = argv[cut + 1:]
    system = "You are a helpful assistant. " + " ".join(f"rule{i % 97} applies" for i in range(a.system_words // 2))
    results = {}
    for mode, flags in (("cache on", []), ("cache off", ["--cache-mem", "0"])):
        proc, url = start(a.model, [*flags, *a.serve_args])
        try:
            # first-request costs (kernels of long prompts) out of the timings; a different first
            # word, so nothing of it is reused
            conversation(url, 1, 2, "Warm-up. " + system)
            results[mode] = conversation(url, a.turns, a.max_tokens, system, mode)
        except httpx.TransportError as e:
            time.sleep(1.0)                     # let its last log lines through
            raise SystemExit(f"lost the server ({mode}, exit code {proc.poll()}): {e}") from None
        finally:
            proc.terminate()
            proc.wait(timeout=30)
    on, off = results["cache on"], results["cache off"]
    print(f"{'turn':>5} {'prompt':>7} {'cached':>7} {'TTFT on (ms)':>13} {'TTFT off (ms)':>14} {'speed-up':>9}  same reply")
    for (label, t_on, reply_on, prompt, cached), (_, t_off, reply_off, _, _) in zip(on, off):
        print(f"{label:>5} {prompt:>7} {cached:>7} {t_on * 1e3:>13.1f} {t_off * 1e3:>14.1f} "
              f"{t_off / max(t_on, 1e-9):>8.1f}x  {'yes' if reply_on == reply_off else 'NO'}")


if __name__ == "__main__":
    main()
