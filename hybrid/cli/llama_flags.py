"""llama.cpp's spellings of options, rewritten to ours before Click parses the command line.

Click reads a single-dash token of several letters as bundled one-letter options, so llama.cpp's
`-ngl 99` would become `-n gl`, `-fa on` `-f a`, `-ctk q8_0` `-c tk`… and fail with a message
about the wrong option. Rewriting argv first gives each of them its meaning here, or, where
llama.cpp's option has no counterpart in this engine, a one-line note naming what to use instead.
"""
from __future__ import annotations

import sys
from typing import Callable, Sequence

from ..errors import HybridError
from ..generate import PREFILL_CHUNK

# Commands that take generation options (decode, chat): the llama-cli / llama-completion spellings.
RENAMES = {
    "-ngl": "--n-gpu-layers", "--gpu-layers": "--n-gpu-layers",
    "-ncmoe": "--n-cpu-moe",
    "-sys": "--system", "--system-prompt": "--system",
    "-s": "--seed",
    "-r": "--stop", "--reverse-prompt": "--stop",
    "-e": "--escape",
    "-ot": "--override-tensor",        # ours already; listed so its value is never rewritten
    "--draft-max": "--draft", "--draft-n": "--draft",
    "--draft-p-min": "--spec-draft-p-min",
    "-dev": "--device",
    "-jf": "--json-schema-file",
}

# llama.cpp's --device names (`none`, `CUDA0`, a comma list) → ours. One GPU is used, the first the
# process sees (CUDA_VISIBLE_DEVICES picks which).
CPU_DEVICE = "none"
FIRST_GPU = "cuda0"

# llama.cpp's -cmoe: every layer's routed experts stay in host memory (its own rule, as an -ot).
CPU_MOE = {"-cmoe", "--cpu-moe"}
CPU_MOE_RULE = r"\.ffn_(up|down|gate)_exps=CPU"

# A separate draft model: none here, the model's own MTP head drafts.
DRAFT_MODEL = {"-md", "--model-draft", "--spec-draft-model", "-hfd", "-hfrd", "--hf-repo-draft", "--spec-draft-hf"}

# Options whose value is the next token: that token is left alone even if it looks like a flag
# (`-p -fa` prompts with the text "-fa").
TAKES_VALUE = {"-p", "--prompt", "-f", "--file", "-m", "--model", "--system", "--stop", "-n", "--n-predict",
               "-c", "--ctx-size", "-t", "--threads", "--temp", "--temperature", "--top-k", "--top-p", "--min-p",
               "--seed", "--override-tensor", "--vram", "--device", "--draft", "--spec-draft-n-max",
               "--chat-template-file", "--n-gpu-layers", "--n-cpu-moe", "--repeat-penalty", "--repeat-last-n",
               "--reasoning", "--presence-penalty", "--frequency-penalty", "--n-probs", "--pcie-share",
               "--spec-draft-p-min", "--typical-p", "--typical", "--xtc-probability", "--xtc-threshold",
               "--dry-multiplier", "--dry-base", "--dry-allowed-length", "--dry-penalty-last-n",
               "--dry-sequence-breaker", "--logit-bias", "-l", "--grammar", "--grammar-file", "-j", "--json-schema",
               "--json-schema-file",
               "--host", "--port", "--api-key", "-a", "--alias", "--cache-mem", "--max-queue", "--max-tokens",
               "--max-body"}

# llama.cpp options that mean nothing here: (value tokens they take, why, what to use instead).
# Values in ON_OFF are optional (older llama.cpp took -fa without one).
ON_OFF = {"on", "off", "auto", "true", "false", "1", "0"}
_LINES = "chat reads a line a message; end a line with \\ or wrap lines in \"\"\" for more"
_ONE_GPU = "one GPU is used, the first CUDA device (CUDA_VISIBLE_DEVICES picks it)"
_CHUNKS = f"prompts are fed in chunks of {PREFILL_CHUNK} tokens here (llama.cpp's default micro-batch)"
IGNORED = {
    "-fa": ("on_off", "hybrid always runs its own fused attention"),
    "--flash-attn": ("on_off", "hybrid always runs its own fused attention"),
    "--jinja": (None, "chat templates are always rendered with Jinja (see --chat-template-file)"),
    "-tb": ("value", "-t sets the threads for both the prompt and generation"),
    "--threads-batch": ("value", "-t sets the threads for both the prompt and generation"),
    "-ctk": ("value", "the KV cache type is fixed here; -c sizes the context"),
    "-ctv": ("value", "the KV cache type is fixed here; -c sizes the context"),
    "--cache-type-k": ("value", "the KV cache type is fixed here; -c sizes the context"),
    "--cache-type-v": ("value", "the KV cache type is fixed here; -c sizes the context"),
    "-b": ("value", _CHUNKS),
    "--batch-size": ("value", _CHUNKS),
    "-ub": ("value", _CHUNKS),
    "--ubatch-size": ("value", _CHUNKS),
    "--no-mmap": (None, "the GGUF is always memory-mapped"),
    "--mlock": (None, "the GGUF is always memory-mapped"),
    "-sm": ("value", _ONE_GPU), "--split-mode": ("value", _ONE_GPU),
    "-mg": ("value", _ONE_GPU), "--main-gpu": ("value", _ONE_GPU),
    "--no-warmup": (None, "the warm-up builds the kernels a run needs; without it the first tokens would wait for them"),
    "--warmup": (None, "the warm-up always runs"),
    "--numa": ("value", "threads follow the OS's placement (pin them with numactl or taskset)"),
    "--log-disable": (None, "the text goes to stdout, the status line to stderr (2>/dev/null hides it)"),
    "-co": ("on_off", "the status line is drawn when stderr is a terminal"),
    "--color": ("on_off", "the status line is drawn when stderr is a terminal"),
    "--perf": (None, "the timings are always printed"),
    "--no-perf": (None, "the timings are always printed"),
    "-v": (None, "nothing more to print"), "--verbose": (None, "nothing more to print"),
    "--verbose-prompt": (None, "nothing more to print"),
    "-lv": ("value", "nothing more to print"), "--verbosity": ("value", "nothing more to print"),
    "--log-verbosity": ("value", "nothing more to print"),
    "-sp": (None, "special tokens are not printed"), "--special": (None, "special tokens are not printed"),
    "--simple-io": (None, _LINES), "-mli": (None, _LINES), "--multiline-input": (None, _LINES),
    "--in-prefix": ("value", "each message goes through the chat template"),
    "--in-suffix": ("value", "each message goes through the chat template"),
    "--in-prefix-bos": (None, "each message goes through the chat template"),
}

# llama-server's options that mean nothing here (serve only).
_ONE_AT_A_TIME = "one request runs at a time here; --max-queue bounds the ones that wait"
SERVER_IGNORED = {"-np": ("value", _ONE_AT_A_TIME), "--parallel": ("value", _ONE_AT_A_TIME),
                  "-cb": (None, _ONE_AT_A_TIME), "--cont-batching": (None, _ONE_AT_A_TIME),
                  "-kvu": (None, _ONE_AT_A_TIME), "--kv-unified": (None, _ONE_AT_A_TIME),
                  "--slots": (None, _ONE_AT_A_TIME), "--no-slots": (None, _ONE_AT_A_TIME),
                  "--metrics": (None, "there is no /metrics endpoint here"),
                  "--props": (None, "there is no /props endpoint here"),
                  "--no-webui": (None, "there is no web UI here, the API alone"),
                  "--embeddings": (None, "there is no embeddings endpoint here"),
                  "--embedding": (None, "there is no embeddings endpoint here"),
                  "-to": ("value", "requests have no server-side timeout (a client that goes away cancels its own)"),
                  "--timeout": ("value", "requests have no server-side timeout (a client that goes away cancels its own)"),
                  "--threads-http": ("value", "the HTTP side is one asyncio loop"),
                  "--reasoning-format": ("value", "reasoning is returned apart, as message.reasoning_content")}
# llama-server's -n: the tokens a request generates when it does not say, and at most (-1: no limit).
SERVER_PREDICT = {"-n", "--n-predict", "--predict"}
# llama-server's prompt-cache size in MiB (-1: no limit, 0: off) is our --cache-mem.
CACHE_RAM = {"-cram", "--cache-ram"}
NO_LIMIT = str(1 << 62)        # bytes: more host memory than any machine has

# llama-bench's options that mean nothing here (bench only; its -p, -n, -pg, -d, -r, -t, -ngl,
# -ncmoe, -ot, -o, -m are bench's own).
_BENCH_FIXED = "fixed here (fused attention, one KV type, 512-token prompt chunks, the mapped file)"
BENCH_IGNORED = {
    **{f: ("value", _BENCH_FIXED) for f in ("-b", "--batch-size", "-ub", "--ubatch-size", "-ctk", "--cache-type-k",
                                           "-ctv", "--cache-type-v", "-fa", "--flash-attn", "-mmp", "--mmap",
                                           "-lm", "--load-mode", "-nkvo", "--no-kv-offload", "-nopo",
                                           "--no-op-offload", "--no-host", "--repack", "-embd", "--embeddings",
                                           "-lzm", "--lazy-mode")},
    **{f: ("value", _ONE_GPU) for f in ("-sm", "--split-mode", "-mg", "--main-gpu", "-ts", "--tensor-split")},
    **{f: ("value", "threads follow the OS's placement") for f in ("--numa", "--prio", "-C", "--cpu-mask",
                                                                   "--cpu-strict", "--poll")},
    "--delay": ("value", "tests run back to back"),
    "-oe": ("value", "the table goes to stdout only"), "--output-err": ("value", "the table goes to stdout only"),
    "-fitt": ("value", "--vram sets the GPU budget"), "--fit-target": ("value", "--vram sets the GPU budget"),
    "-fitc": ("value", "--vram sets the GPU budget"), "--fit-ctx": ("value", "--vram sets the GPU budget"),
    "--progress": (None, "the test running is shown on stderr"), "-v": (None, "nothing more to print"),
    "--verbose": (None, "nothing more to print"),
    "--no-warmup": (None, "each test's untimed warm-up builds what it times"),
}

# Conversation mode is a command of its own here.
CONVERSATION = {"-cnv", "--conversation", "-i", "--interactive", "-if", "--interactive-first"}
NO_CONVERSATION = {"-no-cnv", "--no-conversation"}

GENERATION_COMMANDS = ("decode", "chat")
LLAMA_COMMANDS = (*GENERATION_COMMANDS, "serve")      # commands that take llama.cpp's spellings
BENCH_VALUES = {"-m", "--model", "-p", "--n-prompt", "-n", "--n-gen", "-pg", "-d", "--n-depth", "-r",
                "--repetitions", "-t", "--threads", "-ngl", "--n-gpu-layers", "-ncmoe", "--n-cpu-moe", "-ot",
                "--override-tensor", "-o", "--output", "--vram", "--draft", "--pcie-share"}


def rewrite(argv: Sequence[str], note: Callable[[str], None]) -> list[str]:
    """argv (without the program name) with llama.cpp spellings mapped to ours; `note` gets a
    line for each option that is accepted but has no effect. Raises HybridError for an option
    whose llama.cpp meaning this command cannot honour, naming the command that does."""
    args = list(argv)
    out: list[str] = []
    # -h is --help everywhere (no command uses -h for anything else).
    command = next((a for a in args if not a.startswith("-")), None)
    if command == "bench":
        return _rewrite_bench(args, note)
    generation = command in LLAMA_COMMANDS
    ignored = {**IGNORED, **SERVER_IGNORED} if command == "serve" else IGNORED
    i = 0
    while i < len(args):
        a = args[i]
        if a == "--":
            out += args[i:]
            break
        if a == "-h":
            out.append("--help")
            i += 1
            continue
        if not generation or a == command:
            out.append(a)
            i += 1
            continue
        name, eq, value = a.partition("=") if a.startswith("--") else (a, "", "")
        if name == "-s" and i + 1 < len(args) and not args[i + 1].lstrip("-").isdigit():
            # chat's -s used to be its system message; llama.cpp's -s, and ours now, is the seed
            raise HybridError(f"-s is the seed (llama.cpp's --seed), not {args[i + 1]!r}: "
                              "give a system message with --system or -sys")
        if name in RENAMES:
            name = RENAMES[name]
            a = name + eq + value
        if name == "--device":
            device, i = _value(args, i, eq, value)
            out += ["--device", _our_device(device, note)]
            continue
        if command == "serve" and name in SERVER_PREDICT:
            n, i = _value(args, i, eq, value)
            out += ["--max-tokens", NO_LIMIT if n.strip() == "-1" else n]
            continue
        if name == "--chat-template":
            raise HybridError("--chat-template NAME: llama.cpp's built-in templates are not here; the GGUF's own "
                              "template is used, or a Jinja file given with --chat-template-file")
        if name in DRAFT_MODEL:
            raise HybridError(f"{name}: there is no separate draft model here: the model's own MTP head drafts "
                              "(--draft N or auto; a GGUF without one decodes without drafting)")
        if name in CPU_MOE:
            out += ["--override-tensor", CPU_MOE_RULE]
            i += 1
            continue
        if name in TAKES_VALUE:
            out.append(a)
            if not eq and i + 1 < len(args):
                out.append(args[i + 1])
                i += 1
            i += 1
            continue
        if command == "serve" and name in CACHE_RAM:
            mib, i = _value(args, i, eq, value)
            try:
                n = int(mib)
            except ValueError:
                raise HybridError(f"{name} {mib!r}: give the cache size in MiB (-1: no limit, 0: off)") from None
            if n < -1:
                raise HybridError(f"{name} {n}: give the cache size in MiB (-1: no limit, 0: off)")
            out += ["--cache-mem", NO_LIMIT if n == -1 else f"{n}MiB"]
            continue
        if name in ignored:
            i = _ignore(args, i, name, eq, ignored[name], note)
            continue
        if name == "--reasoning-budget":
            budget, i = _value(args, i, eq, value)
            if budget.strip() in ("0", "-1"):
                # llama.cpp: 0 turns thinking off, -1 leaves it unrestricted (the template's default)
                out += ["--reasoning", "off" if budget.strip() == "0" else "auto"]
            else:
                note(f"--reasoning-budget {budget} is ignored: only 0 (--reasoning off) and -1 (auto) mean "
                     "something here")
            continue
        if name in CONVERSATION:
            if command == "decode":
                raise HybridError(f"{name}: conversation mode is its own command here; run `hybrid chat` "
                                  "(decode generates once; --chat wraps the prompt in the chat template)")
            i += 1          # chat is conversation mode already
            continue
        if name in NO_CONVERSATION:
            if command == "chat":
                raise HybridError(f"{name}: for one generation without a conversation run `hybrid decode`")
            i += 1          # decode never converses
            continue
        out.append(a)
        i += 1
    return out


def _ignore(args: list[str], i: int, name: str, eq: str, entry: tuple, note: Callable[[str], None]) -> int:
    """Note that the option at args[i] is ignored (entry: its (kind, why) in an IGNORED table);
    returns the index past it and the value it takes (kind "value"; "on_off": only a value in
    ON_OFF, which is optional)."""
    kind, why = entry
    note(f"{name} is ignored: {why}")
    i += 1
    if not eq and i < len(args) and (kind == "value" or (kind == "on_off" and args[i].lower() in ON_OFF)):
        i += 1
    return i


def _value(args: list[str], i: int, eq: str, value: str) -> tuple[str, int]:
    """The value of the option at args[i] (`--name=value`, or the next token; "" if none) and
    the index past it."""
    if eq:
        return value, i + 1
    return (args[i + 1], i + 2) if i + 1 < len(args) else ("", i + 1)


def _rewrite_bench(args: list[str], note: Callable[[str], None]) -> list[str]:
    """rewrite() for `bench`, whose options are llama-bench's: only -dev and the options that mean
    nothing here need rewriting (notes); a value that looks like a flag is left alone."""
    out: list[str] = []
    i = 0
    while i < len(args):
        a = args[i]
        name, eq, value = a.partition("=") if a.startswith("--") else (a, "", "")
        if a == "--":
            return out + args[i:]
        if a == "-h":
            out.append("--help")
        elif name in ("-dev", "--device"):
            device, i = _value(args, i, eq, value)
            out += ["--device", _our_device(device, note)]
            continue
        elif name in BENCH_IGNORED:
            i = _ignore(args, i, name, eq, BENCH_IGNORED[name], note)
            continue
        elif name in BENCH_VALUES and not eq and i + 1 < len(args):
            out += [a, args[i + 1]]
            i += 1
        else:
            out.append(a)
        i += 1
    return out


def _our_device(value: str, note: Callable[[str], None]) -> str:
    """--device VALUE as ours: our own names pass; llama.cpp's `none` is the CPU, `CUDA0` the GPU
    (a list keeps its first GPU, with a note); another GPU is an error naming the way to pick it."""
    names = [v.strip().lower() for v in value.split(",") if v.strip()]
    if len(names) == 1 and names[0] in ("auto", "cpu", "cuda"):
        return names[0]
    if names == [CPU_DEVICE]:
        return "cpu"
    if names and names[0] == FIRST_GPU:
        if len(names) > 1:
            note(f"--device {value}: one GPU is used here, CUDA0")
        return "cuda"
    if names and names[0].startswith("cuda") and names[0][4:].isdigit():
        raise HybridError(f"--device {value}: the first GPU the process sees is used; run on "
                          f"{names[0].upper()} with CUDA_VISIBLE_DEVICES={names[0][4:]} --device cuda")
    return value        # (the command's own check names the choices)


def version_requested(argv: Sequence[str]) -> bool:
    return bool(argv) and argv[0] in ("--version", "-V")


def stderr_note(message: str) -> None:
    sys.stderr.write(f"note: {message}\n")
