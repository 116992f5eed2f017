"""Options and helpers shared by the commands that load a model."""
from __future__ import annotations

import json
import re
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Callable, Optional, Sequence

import typer
from rich.console import Console

from gpu import available

from ..api import load
from ..chat_template import ChatTemplate
from ..draft_policy import DraftPolicy
from ..errors import HybridError
from ..grammar import gbnf_grammar, json_schema_grammar
from ..model_file import default_model_path, open_model
from ..placement import DEFAULT_PCIE_SHARE, parse_overrides
from ..sampling import SamplerConfig
from ..state import DEFAULT_N_CTX
from ..units import parse_size

ModelArg = typer.Argument(None, help="GGUF model file (default: the bundled tiny qwen35 model).",
                          show_default=False)
ModelOpt = typer.Option(None, "-m", "--model", help="GGUF model file (same as the MODEL argument).",
                        show_default=False)
ThreadsOpt = typer.Option(None, "-t", "--threads", help="CPU threads (default: all cores available).",
                          show_default=False)
CtxOpt = typer.Option(DEFAULT_N_CTX, "-c", "--ctx-size", help="Context size in tokens (capped at the model's; "
                      "0: the model's own, as llama.cpp's -c 0).")
DeviceOpt = typer.Option("auto", "--device", help="cpu, cuda or auto.")

# Sampling and drafting, shared by decode and chat (llama.cpp's spellings and defaults).
TempOpt = typer.Option(0.8, "--temp", "--temperature", help="Temperature; 0 = greedy.")
TopKOpt = typer.Option(40, "--top-k", help="Keep the k most likely tokens (0 = off).")
TopPOpt = typer.Option(0.95, "--top-p", help="Nucleus sampling mass (1.0 = off).")
MinPOpt = typer.Option(0.05, "--min-p", help="Drop tokens below min_p × the top probability (0 = off).")
RepeatPenaltyOpt = typer.Option(1.0, "--repeat-penalty", help="Penalty for recent tokens (1.0 = off).")
RepeatLastNOpt = typer.Option(64, "--repeat-last-n", help="How many recent tokens the penalties look at (-1 = all).")
PresencePenaltyOpt = typer.Option(0.0, "--presence-penalty", help="Subtract this from every token seen in the window (0 = off).")
FrequencyPenaltyOpt = typer.Option(0.0, "--frequency-penalty",
                                   help="Subtract this × its count in the window from each token (0 = off).")
TypicalPOpt = typer.Option(1.0, "--typical-p", "--typical", help="Locally typical sampling mass (1.0 = off).")
XtcProbabilityOpt = typer.Option(0.0, "--xtc-probability", help="XTC: chance per token of cutting the likeliest tokens (0 = off).")
XtcThresholdOpt = typer.Option(0.1, "--xtc-threshold", help="XTC: tokens at or above this probability, but the least likely, are cut.")
DryMultiplierOpt = typer.Option(0.0, "--dry-multiplier", help="DRY: penalty for extending a repeated run (0 = off).")
DryBaseOpt = typer.Option(1.75, "--dry-base", help="DRY: the penalty grows by this factor per token of the run.")
DryAllowedLengthOpt = typer.Option(2, "--dry-allowed-length", help="DRY: runs this long go unpunished.")
DryLastNOpt = typer.Option(-1, "--dry-penalty-last-n", help="DRY: how many recent tokens it looks at (-1 = all).")
DryBreakerOpt = typer.Option([], "--dry-sequence-breaker",
                             help="DRY: text a repeated run cannot cross (repeatable; default \\n : \" *).")
LogitBiasOpt = typer.Option([], "--logit-bias", "-l",
                            help="TOKEN_ID+BIAS or TOKEN_ID-BIAS added to that token's logit, e.g. 15043+1 or "
                                 "15043-inf to ban it (repeatable).")
SeedOpt = typer.Option(-1, "-s", "--seed", min=-1, help="Random seed (-1 = random).")
GrammarOpt = typer.Option(None, "--grammar", help="Constrain the output to this grammar (GBNF, as llama.cpp's "
                          "grammars/*.gbnf, or Lark). Drafts are checked against it too.", show_default=False)
GrammarFileOpt = typer.Option(None, "--grammar-file", help="Read --grammar from a file.", show_default=False)
JsonSchemaOpt = typer.Option(None, "-j", "--json-schema", help="Constrain the output to JSON this schema accepts "
                             "(e.g. '{}' for any JSON object). Drafts are checked against it too.", show_default=False)
JsonSchemaFileOpt = typer.Option(None, "--json-schema-file", help="Read --json-schema from a file.", show_default=False)
DraftOpt = typer.Option(
    None, "--draft", "--spec-draft-n-max",
    help="MTP draft depth per step: 0 = off, N, or 'auto' (picked from measured acceptance and step "
         "cost, remembered per model and placement in ~/.cache/hybrid/draft-depth for the next run). "
         "Default: auto when the model has an MTP head, else 0.")
DraftPMinOpt = typer.Option(0.0, "--spec-draft-p-min", min=0.0, max=1.0,
                            help="Stop a draft when the MTP head's top probability falls below this (0 = never).")
VramOpt = typer.Option(None, "--vram", help="GPU memory budget, e.g. 12GiB, 8G, 500MiB "
                       "(default: the GPU's free memory).", show_default=False)
CpuOnlyOpt = typer.Option(False, "--cpu-only", help="Keep everything on the CPU (no GPU needed).")
CudaGraphsOpt = typer.Option(True, "--cuda-graphs/--no-cuda-graphs",
                             help="Replay each repeated step's GPU work as a CUDA graph (one driver call "
                                  "per CPU hand-off instead of ~15 kernel launches per layer). Off: launch "
                                  "kernels one by one (debugging, timing comparisons).")
ExpertCacheOpt = typer.Option(True, "--expert-cache/--no-expert-cache",
                              help="MoE models: copy as many routed experts of each layer as the VRAM left "
                                   "over holds to the GPU, which runs them when a token picks them (the rest "
                                   "run on the CPU).")
PcieShareOpt = typer.Option(DEFAULT_PCIE_SHARE, "--pcie-share", min=0.0, max=1.0,
                            help="MoE models with a GPU: of the routed experts a token picks that the GPU does "
                                 "not cache, the share the GPU reads itself from host memory over PCIe while "
                                 "the CPU runs the rest (0 = the CPU runs them all). The host's memory serves "
                                 "both readers at once.")
SplitFfnOpt = typer.Option(False, "--split-ffn/--no-split-ffn",
                           help="Dense models whose FFN layers do not all fit the VRAM: give every FFN layer "
                                "the same share of the GPU, which computes those hidden rows while the CPU "
                                "computes the rest of the layer (off: as many whole layers as fit, on the GPU).")
OverrideTensorOpt = typer.Option(
    [], "-ot", "--override-tensor",
    help="Pin tensors whose name matches REGEX to a side: REGEX=CPU or REGEX=GPU (repeatable, "
         "first match wins; like llama.cpp's -ot), e.g. -ot 'blk\\.[0-9]\\.ffn_.*=GPU'.")

NGpuLayersOpt = typer.Option(
    None, "--n-gpu-layers", "-ngl", show_default=False,
    help="llama.cpp's -ngl: put the first N layers (trunk and FFN) on the GPU; 0 = --cpu-only, "
         "-1 or 'all' = every layer. The rest is placed as the VRAM budget allows.")
NCpuMoeOpt = typer.Option(
    None, "--n-cpu-moe", "-ncmoe", show_default=False,
    help="llama.cpp's --n-cpu-moe: keep the routed experts of the first N layers on the CPU.")
StopOpt = typer.Option([], "--stop", "--reverse-prompt", "-r", help="Stop when this text appears (repeatable).")
IgnoreEosOpt = typer.Option(False, "--ignore-eos", help="Keep going past end-of-generation tokens.")
ChatTemplateFileOpt = typer.Option(None, "--chat-template-file", show_default=False,
                                   help="Render chats with this Jinja template instead of the GGUF's.")
ReasoningOpt = typer.Option(
    "auto", "--reasoning",
    help="Thinking models: on, off, or auto (the chat template's default). Reasoning is shown dim on a "
         "terminal and kept out of --json's text (its own 'reasoning' field).")


def grammar_option(grammar: str | None, grammar_file: Path | None, json_schema: str | None,
                   json_schema_file: Path | None) -> str | None:
    """The llguidance grammar of llama.cpp's --grammar / --grammar-file / -j / -jf (one of them)."""
    given = [name for name, v in (("--grammar", grammar), ("--grammar-file", grammar_file),
                                  ("--json-schema", json_schema), ("--json-schema-file", json_schema_file)) if v is not None]
    if len(given) > 1:
        raise HybridError(f"give one of {', '.join(given)}, not several")
    if grammar_file is not None:
        grammar = read_text_file(grammar_file, "grammar file")
    if json_schema_file is not None:
        json_schema = read_text_file(json_schema_file, "JSON schema file")
    if grammar is not None:
        return gbnf_grammar(grammar)
    if json_schema is None:
        return None
    try:
        schema = json.loads(json_schema)
    except json.JSONDecodeError as e:
        raise HybridError(f"--json-schema is not JSON: {e}") from None
    if not isinstance(schema, dict):
        raise HybridError("--json-schema must be a JSON object (a schema)")
    return json_schema_grammar(schema or None)


def reasoning_with_grammar(think: bool | None, grammar: str | None) -> bool | None:
    """--reasoning under a grammar, which holds from the reply's first token: off (on is an error)."""
    if grammar is None:
        return think
    if think:
        raise HybridError("a grammar (--grammar, -j) needs --reasoning off: it holds from the reply's first token")
    return False


def sampler_extras(typical_p: float, xtc_probability: float, xtc_threshold: float, dry_multiplier: float,
                   dry_base: float, dry_allowed_length: int, dry_penalty_last_n: int, dry_breakers: Sequence[str],
                   logit_bias: Sequence[str]) -> dict:
    """The llama.cpp sampler options as `Model.generate` keyword arguments."""
    extras = dict(typical_p=typical_p, xtc_probability=xtc_probability, xtc_threshold=xtc_threshold,
                  dry_multiplier=dry_multiplier, dry_base=dry_base, dry_allowed_length=dry_allowed_length,
                  dry_penalty_last_n=dry_penalty_last_n, logit_bias=parse_logit_bias(logit_bias))
    if dry_breakers:
        extras["dry_sequence_breakers"] = tuple(dry_breakers)
    return extras


def parse_logit_bias(items: Sequence[str]) -> dict[int, float]:
    """llama.cpp's --logit-bias TOKEN_ID(+|-)BIAS."""
    out: dict[int, float] = {}
    for item in items:
        m = re.fullmatch(r"\s*(\d+)\s*([+-]\s*(?:inf|[0-9.]+(?:e[+-]?\d+)?))\s*", str(item), flags=re.I)
        if m is None:
            raise HybridError(f"--logit-bias {item!r}: write TOKEN_ID+BIAS or TOKEN_ID-BIAS, e.g. 15043+1 or 15043-inf")
        out[int(m.group(1))] = float(m.group(2).replace(" ", ""))
    return out


def parse_reasoning(value: str) -> bool | None:
    """--reasoning on|off|auto → the template's enable_thinking (None: the template decides)."""
    v = value.strip().lower()
    if v in ("on", "true", "1"):
        return True
    if v in ("off", "false", "0"):
        return False
    if v == "auto":
        return None
    raise HybridError(f"--reasoning {value!r}: use on, off or auto")


def predict_limit(n_predict: int) -> Optional[int]:
    """llama.cpp's -n as a token limit: a count, or None for -1 (no limit) and -2 (until the
    context is full), which both end where the context does here."""
    if n_predict in (-1, -2):
        return None
    if n_predict < 0:
        raise HybridError(f"-n must be ≥ 0, -1 (no limit) or -2 (until the context is full), got {n_predict}")
    return n_predict


def layer_rules(n_gpu_layers: Optional[str], n_cpu_moe: Optional[int]) -> tuple[list[str], bool]:
    """-ngl / -ncmoe as override rules (first match wins, so the CPU experts of -ncmoe come first),
    and whether -ngl 0 asked for the CPU alone."""
    rules: list[str] = []
    if n_cpu_moe is not None:
        if n_cpu_moe < 0:
            raise HybridError(f"--n-cpu-moe must be ≥ 0, got {n_cpu_moe}")
        if n_cpu_moe > 0:
            rules.append(rf"^blk\.{_layers_below(n_cpu_moe)}\.ffn_.*_exps\.=CPU")
    if n_gpu_layers is None:
        return rules, False
    v = str(n_gpu_layers).strip().lower()
    if v in ("all", "auto", "-1"):
        return rules + [r"^blk\.\d+\.=GPU"], False
    try:
        n = int(v)
    except ValueError:
        raise HybridError(f"-ngl {n_gpu_layers!r}: give a layer count, -1 or 'all'") from None
    if n < 0:
        raise HybridError(f"-ngl must be ≥ 0, -1 or 'all', got {n}")
    if n == 0:
        return rules, True
    return rules + [rf"^blk\.{_layers_below(n)}\.=GPU"], False


def _layers_below(n: int) -> str:
    """A regex group matching the layer numbers 0 … n-1 (any number, when n covers every model's)."""
    if n >= 1000:
        return r"\d+"
    return "(?:" + "|".join(str(i) for i in range(n)) + ")"


def check_sampling(*, temp: float, top_k: int, top_p: float, min_p: float, repeat_penalty: float,
                   seed: int, repeat_last_n: int = 64) -> None:
    """Every sampling option checked before the model loads (a bad --top-p should not cost a
    minute of loading first): SamplerConfig holds the rules."""
    SamplerConfig(temperature=temp, top_k=top_k, top_p=top_p, min_p=min_p, repeat_penalty=repeat_penalty,
                  repeat_last_n=repeat_last_n, seed=None if seed < 0 else seed)


def pick_model(arg: Optional[Path], opt: Optional[Path]) -> Optional[Path]:
    if arg is not None and opt is not None and arg != opt:
        raise HybridError(f"two models given ({arg} and {opt}): use either MODEL or -m")
    return opt or arg


@contextmanager
def status(console: Console, message: str, enabled: bool = True):
    """A spinner for slow steps (loading, first-run kernel compilation) instead of a silent pause."""
    if enabled and console.is_terminal:
        with console.status(message, spinner="dots"):
            yield
    else:
        yield


def read_text_file(path: Path, what: str) -> str:
    """A UTF-8 text file the user named (`what` it is, for the one-line error)."""
    try:
        return Path(path).read_text(encoding="utf-8")
    except OSError as e:
        raise HybridError(f"cannot read {what} {path}: {e.strerror}") from None
    except UnicodeDecodeError:
        raise HybridError(f"{what} {path} is not UTF-8 text") from None


def read_template(path: Optional[Path]) -> Optional[str]:
    return None if path is None else read_text_file(path, "chat template file")


def placement_options(device: str, vram: Optional[str], cpu_only: bool,
                      overrides: Sequence[str]) -> tuple[str, dict]:
    """Check --vram / --cpu-only / -ot before anything loads; returns (device, extra load() kwargs).

    --cpu-only is device cpu; a bad --vram or -ot fails here, before the model is opened.
    """
    if cpu_only:
        if device == "cuda":
            raise HybridError("--cpu-only and --device cuda contradict each other; pick one")
        device = "cpu"
    extra: dict = {}
    if vram is not None:
        parse_size(vram, "VRAM budget (--vram)")
        extra["vram"] = vram
    if overrides:
        parse_overrides(overrides)
        extra["overrides"] = tuple(overrides)
    return device, extra


class KernelProgress:
    """progress(done, total) for `Model.warmup`: "compiling GPU kernels 12/40" on a terminal while
    they compile ("12/?" while the total is not known yet), then one line with the count and the
    time; off a terminal the first line and the last. Shows nothing when no kernel compiles (all
    came from Numba's disk cache)."""

    def __init__(self, console: Console, enabled: bool = True, where: str = "CPU"):
        self.console, self.enabled, self.where = console, enabled, where
        self._status = None
        self._started = None
        self._last = (0, 0)

    def __call__(self, done: int, total: Optional[int]) -> None:
        if not self.enabled or total == 0:
            return
        self._last = (done, total)
        message = f"compiling {self.where} kernels {done}/{total or '?'} (first run only, then cached)…"
        if self._started is None:
            self._started = time.perf_counter()
            if self.console.is_terminal:
                self._status = self.console.status(message, spinner="dots")
                self._status.start()
            else:
                self.console.print(message, highlight=False)
        elif self._status is not None:
            self._status.update(message)

    def close(self) -> None:
        if self._status is not None:
            self._status.stop()
        if self._started is not None:
            done, total = self._last
            seconds = time.perf_counter() - self._started
            self.console.print(f"compiled {self.where} kernels {done}/{total or done} in {seconds:.1f} s (cached for later runs)",
                               style="dim", highlight=False)


def load_model(path: Optional[Path], *, device: str, threads: Optional[int], n_ctx: int,
               console: Console, quiet: bool = False, vram: Optional[str] = None, cpu_only: bool = False,
               overrides: Sequence[str] = (), cuda_graphs: bool = True, expert_cache: bool = True,
               pcie_share: float = DEFAULT_PCIE_SHARE, split_ffn: bool = False, max_rows: Optional[Callable] = None,
               n_gpu_layers: Optional[str] = None, n_cpu_moe: Optional[int] = None,
               chat_template_file: Optional[Path] = None, draft: Optional[str] = None):
    """Load and warm up a model. max_rows(model) → the most token rows one forward call of the
    job takes (its prompt, a draft verify step), when known: the warm-up then compiles only the
    kernels of calls that size (`Model.warmup`); draft: the job's --draft, whose deepest verify
    the warm-up prepares too."""
    if n_ctx == 0:                      # llama.cpp's -c 0: the context the model was made for
        with open_model(path or default_model_path()) as f:
            n_ctx = f.config.context_length
    rules, ngl_cpu = layer_rules(n_gpu_layers, n_cpu_moe)
    if rules and device != "cuda" and not cpu_only:
        if not available():
            rules = []       # nothing to split without a GPU: said below, once the CPU run is loaded
    template = read_template(chat_template_file)
    if template is not None:
        ChatTemplate(template)        # a template that does not parse fails before the model loads
    device, extra = placement_options(device, vram, cpu_only or ngl_cpu, list(overrides) + rules)
    with status(console, "loading model…", not quiet):
        model = load(path, device=device, threads=threads, n_ctx=n_ctx, cuda_graphs=cuda_graphs,
                     expert_cache=expert_cache, pcie_share=pcie_share, split_ffn=split_ffn, **extra)
    if template is not None:
        model.chat_template = ChatTemplate(template, bos_token=model.chat_template.bos_token,
                                           eos_token=model.chat_template.eos_token)
    asked_gpu = [name for name, given in (("--vram", vram is not None), ("-ngl", n_gpu_layers is not None and not ngl_cpu),
                                          ("--n-cpu-moe", bool(n_cpu_moe)), ("-ot", bool(overrides)))
                 if given]
    if asked_gpu and model.device == "cpu" and not (cpu_only or ngl_cpu):
        # auto found no GPU: the run goes on, on the CPU, but not as if those options had placed anything
        console.print(f"note: no CUDA GPU found: {', '.join(asked_gpu)} ignored, running on the CPU",
                      style="yellow", highlight=False, soft_wrap=True)
    rows = max_rows(model) if max_rows is not None else None
    depth = DraftPolicy.parse(draft, model.has_mtp).max_depth
    progress = KernelProgress(console, not quiet, "CPU" if model.device == "cpu" else "GPU")
    try:
        model.warmup(rows, progress=progress, draft_depth=depth)
    finally:
        progress.close()
    return model
