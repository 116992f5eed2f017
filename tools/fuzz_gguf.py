"""Fuzz the GGUF reading path with mutated small models, each case isolated in a forked child.

    python tools/fuzz_gguf.py --cases 1000 [--seed 0] [--time-limit 10] [--mem-limit-mib 1024]

Seed files are the project's own synthetic models (`hybrid.synth.write_model`, tiny preset, one
per architecture). A case applies 1-3 mutations: a metadata value replaced by one of another type
or range (NaN, ±Inf, huge or negative counts, strings with escape codes or bytes that are not
UTF-8, scalars for arrays and arrays for scalars, 400-deep nested arrays), keys removed or added
(a 40,000-byte key), a hostile chat template, tensor-table edits, or raw byte flips and cuts.

Each case runs in a child forked from this process (imports are already paid), under
RLIMIT_AS and RLIMIT_CPU, and with a wall-clock limit: the child opens the file as the engine
does (`open_model`, `info`'s summary and rendering, the tokenizer, the chat template rendered
and tokenized) and reports one of

  ok          everything built and ran
  error       one clean HybridError (its message is one printable line, not too long)
  bad-message a HybridError whose raw message has control characters, newlines or > 2000 chars
  traceback   any other exception
  crash       the child died from a signal it was not sent for a limit
  hang        over the time limit (killed)
  over-memory a MemoryError, the address-space limit hit, or a peak RSS above --mem-limit-mib
              (counted from the child's start: the pages it shares with this process are not its own)

and prints the counts; examples of every outcome but ok/error are written under --keep.
"""
from __future__ import annotations

import argparse
import io
import json
import math
import os
import random
import resource
import signal
import struct
import sys
import tempfile
import time
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

OUTCOMES = ("ok", "error", "bad-message", "traceback", "crash", "hang", "over-memory")
ARCHS = ("qwen35", "qwen35moe", "qwen3next")
MAX_MESSAGE = 2000
DEFAULT_RECURSION_LIMIT = sys.getrecursionlimit()

# GGUF value type ids
U8, I8, U16, I16, U32, I32, F32, BOOL, STR, ARR, U64, I64, F64 = range(13)

HOSTILE_TEMPLATES = [
    "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}",
    "{% set ns = namespace(s='ab') %}{% for i in range(64) %}{% set ns.s = ns.s ~ ns.s %}{% endfor %}{{ ns.s }}",
    "{{ 'x' * 1000000000 }}",
    "{{ 'x'.center(1000000000) }}",
    "{{ raise_exception('no \x1b[2J') }}",
    "{% for m in messages %}{{ m.content ~ m.content }}" * 50 + "{% endfor %}" * 50,
    "{{ " + "(" * 2000 + "1" + ")" * 2000 + " }}",
    "{% macro f(n) %}{{ f(n + 1) }}{% endmacro %}{{ f(0) }}",
    "{{ messages.__class__.__mro__ }}",
    "{% if %}",
    "{{ 9 ** 9 ** 9 }}",
]
STRINGS = ["", "x", "oops [/bold] x", "[link=file:///etc/passwd]click[/link]", "\x1b]0;pwned\x07\x1b[2J",
           "a\x00b", "\udcff\udcfe", "gpt2", "qwen35", "qwen2", "llama", "ü" * 3, "9" * 30,
           "x" * 40000, "{{ 1 }}", "left right", "Ġ Ġ", "<|im_end|>"]
NUMBERS = [0, 1, -1, 2, 3, 4, 7, 255, 256, 65535, 2**31 - 1, 2**31, 2**32 - 1, 2**32, 2**63 - 1,
           -2**63, 10**6, 10**9, math.nan, math.inf, -math.inf, 0.5, -0.0, 1e-30, 1e30]
KEY_TARGETS = ["block_count", "embedding_length", "context_length", "feed_forward_length",
               "attention.head_count", "attention.head_count_kv", "attention.key_length",
               "attention.value_length", "attention.layer_norm_rms_epsilon", "rope.dimension_count",
               "rope.freq_base", "rope.dimension_sections", "ssm.conv_kernel", "ssm.state_size",
               "ssm.group_count", "ssm.time_step_rank", "ssm.inner_size", "full_attention_interval",
               "nextn_predict_layers", "expert_count", "expert_used_count", "expert_feed_forward_length",
               "expert_shared_feed_forward_length", "attention.recurrent_layers"]
GLOBAL_TARGETS = ["general.architecture", "general.name", "general.alignment", "general.file_type",
                  "tokenizer.ggml.model", "tokenizer.ggml.pre", "tokenizer.ggml.tokens",
                  "tokenizer.ggml.token_type", "tokenizer.ggml.merges", "tokenizer.ggml.eos_token_id",
                  "tokenizer.ggml.bos_token_id", "tokenizer.ggml.padding_token_id",
                  "tokenizer.ggml.add_bos_token", "tokenizer.chat_template",
                  "tokenizer.ggml.eot_token_id", "tokenizer.ggml.fim_pad_token_id"]


# --- encoding --------------------------------------------------------------------------------

def _type_of(v) -> int:
    if isinstance(v, bool):
        return BOOL
    if isinstance(v, int):
        return U32 if 0 <= v < 2**32 else I64 if -2**63 <= v < 2**63 else U64
    if isinstance(v, float):
        return F32 if not math.isfinite(v) or abs(v) < 1e38 else F64
    if isinstance(v, str):
        return STR
    if isinstance(v, list):
        return ARR
    raise TypeError(type(v))


_FMT = {U8: "<B", I8: "<b", U16: "<H", I16: "<h", U32: "<I", I32: "<i", F32: "<f", BOOL: "<?",
        U64: "<Q", I64: "<q", F64: "<d"}


def _string(s: str) -> bytes:
    b = s.encode("utf-8", "surrogateescape")
    return struct.pack("<Q", len(b)) + b


def _value(t: int, v) -> bytes:
    if t == STR:
        return _string(v)
    if t == ARR:
        types = {_type_of(x) for x in v} or {U32}
        if types <= {U32, I64, U64, F32, F64} and types & {F32, F64}:
            et = F64
        elif types <= {U32, I64, U64}:
            et = U32 if types == {U32} else I64 if all(x >= -2**63 and x < 2**63 for x in v) else U64
        else:
            et = _type_of(v[0])
        return struct.pack("<IQ", et, len(v)) + b"".join(_value(et, x) for x in v)
    if t == U64 and isinstance(v, int) and v < 0:
        t = I64
    return struct.pack(_FMT[t], v)


def encode(metadata: dict, tensors: list, data: bytes, alignment: int) -> bytes:
    parts = [b"GGUF", struct.pack("<IQQ", 3, len(tensors), len(metadata))]
    for k, v in metadata.items():
        t = _type_of(v)
        parts.append(_string(k) + struct.pack("<I", t) + _value(t, v))
    for name, ne, type_id, offset in tensors:
        parts.append(_string(name) + struct.pack(f"<I{len(ne)}QIQ", len(ne), *ne, type_id, offset))
    head = b"".join(parts)
    pad = (-len(head)) % alignment if alignment > 0 and alignment & (alignment - 1) == 0 else (-len(head)) % 32
    return head + bytes(pad) + data


# --- mutations -------------------------------------------------------------------------------

def random_value(rng: random.Random):
    kind = rng.random()
    if kind < 0.35:
        return rng.choice(NUMBERS)
    if kind < 0.6:
        return rng.choice(STRINGS)
    if kind < 0.75:
        return [rng.choice(NUMBERS) for _ in range(rng.choice([0, 1, 3, 8]))]
    if kind < 0.85:
        return [rng.choice(STRINGS[:8]) for _ in range(rng.choice([0, 1, 3]))]
    if kind < 0.9:
        v = [1]
        for _ in range(rng.choice([2, 20, 400])):
            v = [v]
        return v
    return rng.choice([True, False])


def mutate(rng: random.Random, seed: dict) -> tuple[bytes, list[str]]:
    meta = dict(seed["metadata"])
    tensors = list(seed["tensors"])
    arch = meta.get("general.architecture", "qwen35")
    did = []
    for _ in range(rng.choice([1, 1, 2, 3])):
        op = rng.random()
        if op < 0.45:
            key = (f"{arch}." + rng.choice(KEY_TARGETS)) if rng.random() < 0.55 else rng.choice(GLOBAL_TARGETS)
            meta[key] = random_value(rng)
            did.append(f"set {key}={shown(meta[key])}")
        elif op < 0.55:
            key = rng.choice(list(meta))
            meta.pop(key)
            did.append(f"drop {key}")
        elif op < 0.6:
            key = rng.choice(["\x00" * 40000, "k\x1b[31m", "\udcff", "x" * 40000 + "\x07"])
            meta[key] = random_value(rng)
            did.append("garbage key")
        elif op < 0.68:
            meta["tokenizer.chat_template"] = rng.choice(HOSTILE_TEMPLATES)
            did.append("hostile template")
        elif op < 0.74:
            toks = meta.get("tokenizer.ggml.tokens")
            if isinstance(toks, list) and toks and isinstance(toks[0], str):
                toks = list(toks)
                i = rng.randrange(len(toks))
                toks[i] = rng.choice(["\udcff\udcfe", "<|im_end|>", "", "Ġ\udc80", toks[0]])
                meta["tokenizer.ggml.tokens"] = toks
                did.append(f"token {i}")
        elif op < 0.84:
            if tensors:
                i = rng.randrange(len(tensors))
                name, ne, type_id, offset = tensors[i]
                which = rng.randrange(5)
                if which == 0:
                    ne = tuple(rng.choice([0, 1, 2**40, 2**63, n * 2]) if rng.random() < 0.5 else n for n in ne)
                elif which == 1:
                    type_id = rng.choice([0, 1, 2, 8, 12, 14, 16, 30, 99, 2**31])
                elif which == 2:
                    offset = rng.choice([0, 1, 2**62, offset + 32, offset * 3])
                elif which == 3:
                    name = rng.choice([tensors[0][0], "\x1b[2J", "x" * 5000, ""])
                else:
                    tensors.pop(i)
                if which != 4:
                    tensors[i] = (name, ne, type_id, offset)
                did.append(f"tensor {i} edit {which}")
        else:
            did.append("bytes")
    out = encode(meta, tensors, seed["data"], seed["alignment"])
    if "bytes" in did:
        out = bytearray(out)
        head_end = len(out) - len(seed["data"])
        for _ in range(rng.choice([1, 4, 16])):
            pos = rng.randrange(min(head_end, len(out)))
            out[pos] = rng.randrange(256)
        if rng.random() < 0.3:
            out = out[:rng.randrange(len(out))]
        out = bytes(out)
    return out, did


def shown(v) -> str:
    r = repr(v)
    return r if len(r) < 60 else r[:57] + "..."


# --- one case in a child ---------------------------------------------------------------------

def exercise(path: str) -> None:
    """What the engine does with a file before any forward: everything that reads metadata."""
    from rich.console import Console

    from hybrid.chat_template import ChatTemplate
    from hybrid.cli.info import render
    from hybrid.model_file import open_model
    from hybrid.summary import summarize
    from hybrid.tokenizer import Tokenizer

    with open_model(path) as m:
        s = summarize(m)
        json.dumps(s)
        render(s, Console(file=io.StringIO(), width=100))
        tok = Tokenizer.from_metadata(m.metadata)
        ids = tok.encode("Hello <|im_start|> wörld 123")
        tok.decode(ids)
        text = ChatTemplate.from_metadata(m.metadata).render([{"role": "user", "content": "hi there"}])
        tok.encode(text)


def _statm(field: int) -> int:
    """Bytes of /proc/self/statm's field (0: mapped, 1: resident) now; 0 where /proc is missing."""
    try:
        return int(Path("/proc/self/statm").read_text().split()[field]) * resource.getpagesize()
    except (OSError, ValueError, IndexError):
        return 0


def _peak_rss_kib() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss


def child(path: str, out_fd: int, time_limit: float, mem_limit: int) -> None:
    from hybrid.errors import HybridError
    # A forked child starts with this process's resident pages as its peak RSS and its mappings as
    # its address space (a test worker that compiled kernels holds ~1 GiB); both limits count from there.
    start_kib = _peak_rss_kib()
    limit_as = _statm(0) + mem_limit * 3
    sys.setrecursionlimit(DEFAULT_RECURSION_LIMIT)    # the engine's own, not the encoder's
    resource.setrlimit(resource.RLIMIT_AS, (limit_as, limit_as))   # hard stop; RSS judged after
    resource.setrlimit(resource.RLIMIT_CPU, (int(time_limit) + 2, int(time_limit) + 3))
    try:
        exercise(path)
        result = {"outcome": "ok"}
    except HybridError as e:
        msg = str(e)
        clean = len(msg) <= MAX_MESSAGE and msg.isprintable()
        result = {"outcome": "error" if clean else "bad-message", "message": msg[:300]}
    except MemoryError:
        result = {"outcome": "over-memory", "message": "MemoryError"}
    except BaseException:
        result = {"outcome": "traceback", "message": traceback.format_exc()[-3000:]}
    result["rss_kib"] = _peak_rss_kib() - start_kib
    os.write(out_fd, json.dumps(result, ensure_ascii=True).encode())
    os._exit(0)


def run_case(path: str, time_limit: float, mem_limit: int) -> dict:
    shared_kib = _statm(1) // 1024     # the child's RSS at birth, for a child that cannot report
    r, w = os.pipe()
    t0 = time.monotonic()
    pid = os.fork()
    if pid == 0:
        os.close(r)
        try:
            child(path, w, time_limit, mem_limit)
        finally:
            os._exit(3)
    os.close(w)
    killed = False
    status = rusage = None
    while True:
        done, status, rusage = os.wait4(pid, os.WNOHANG)
        if done:
            break
        if time.monotonic() - t0 > time_limit:
            os.kill(pid, signal.SIGKILL)
            killed = True
            _, status, rusage = os.wait4(pid, 0)
            break
        time.sleep(0.005)
    data = b""
    while chunk := os.read(r, 65536):
        data += chunk
    os.close(r)
    seconds = time.monotonic() - t0
    if killed:
        return {"outcome": "hang", "seconds": seconds}
    if data:
        result = json.loads(data)
    elif os.WIFSIGNALED(status) and os.WTERMSIG(status) in (signal.SIGXCPU, signal.SIGKILL):
        result = {"outcome": "hang", "message": "CPU limit"}
    else:
        # a child that could not allocate under RLIMIT_AS may die without a word
        result = {"outcome": "crash", "message": f"status {status}"}
    result["seconds"] = seconds
    if "rss_kib" not in result:
        result["rss_kib"] = max(0, rusage.ru_maxrss - shared_kib) if rusage else 0
    if result["outcome"] in ("ok", "error") and result["rss_kib"] > mem_limit // 1024:
        result["outcome"] = "over-memory"
    return result


def seeds(folder: Path) -> list[dict]:
    from hybrid.gguf_file import read_gguf
    from hybrid.synth import preset, write_model
    out = []
    for arch in ARCHS:
        path = folder / f"seed-{arch}.gguf"
        if not path.exists():
            write_model(path, preset("tiny", arch), seed=0)
        g = read_gguf(path)
        out.append({"metadata": dict(g.metadata),
                    "tensors": [(t.name, t.ne, t.type_id, t.rel_offset) for t in g.tensor_infos],
                    "data": bytes(g.buf[g.data_offset:]), "alignment": g.alignment})
        g.close()
    return out


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--cases", type=int, default=300)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--time-limit", type=float, default=10.0, help="seconds per case")
    ap.add_argument("--mem-limit-mib", type=int, default=1024, help="peak RSS per case")
    ap.add_argument("--keep", type=Path, default=None, help="folder for the files of bad outcomes")
    ap.add_argument("--max-seconds", type=float, default=None,
                    help="stop after this long and report the cases run so far")
    ap.add_argument("--quiet", action="store_true")
    args = ap.parse_args(argv)
    sys.setrecursionlimit(max(sys.getrecursionlimit(), 10000))   # encoding 400-deep arrays
    # imports paid once here, before the children fork
    import hybrid.chat_template, hybrid.cli.info, hybrid.summary, hybrid.tokenizer  # noqa: F401,E401
    import tokenizers  # noqa: F401
    counts = {k: 0 for k in OUTCOMES}
    worst = {"seconds": 0.0, "rss_kib": 0}
    rng = random.Random(args.seed)
    with tempfile.TemporaryDirectory(prefix="fuzz_gguf") as tmp:
        tmp = Path(tmp)
        base = seeds(Path(os.environ.get("FUZZ_GGUF_SEEDS", tmp)))
        case = tmp / "case.gguf"
        t0 = time.monotonic()
        n_run = 0
        for n in range(args.cases):
            if args.max_seconds is not None and time.monotonic() - t0 > args.max_seconds:
                break
            n_run += 1
            data, did = mutate(rng, rng.choice(base))
            case.write_bytes(data)
            res = run_case(str(case), args.time_limit, args.mem_limit_mib << 20)
            counts[res["outcome"]] += 1
            worst["seconds"] = max(worst["seconds"], res["seconds"])
            worst["rss_kib"] = max(worst["rss_kib"], res["rss_kib"])
            if res["outcome"] not in ("ok", "error"):
                if not args.quiet:
                    print(f"case {n}: {res['outcome']} after {' · '.join(did)}\n  "
                          f"{res.get('message', '')[-1500:]}", file=sys.stderr)
                if args.keep:
                    args.keep.mkdir(parents=True, exist_ok=True)
                    (args.keep / f"case{n}-{res['outcome']}.gguf").write_bytes(data)
            if not args.quiet and (n + 1) % 100 == 0:
                print(f"{n + 1} cases, {time.monotonic() - t0:.0f} s: {counts}", file=sys.stderr, flush=True)
    summary = {"cases": n_run, **counts, "elapsed_s": round(time.monotonic() - t0),
               "max_seconds": round(worst["seconds"], 2), "max_rss_mib": round(worst["rss_kib"] / 1024, 1)}
    print(json.dumps(summary))
    return summary


if __name__ == "__main__":
    main()
