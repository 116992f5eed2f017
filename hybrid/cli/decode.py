"""`hybrid decode`: stream a continuation of a prompt with a live tokens/s display."""
from __future__ import annotations

import json
import os
import re
import stat
import sys
from pathlib import Path
from typing import List, Optional

import numpy as np
import typer
from rich.console import Console

from ..draft_policy import DraftPolicy
from ..errors import HybridError
from ..events import Done, Token
from . import app
from .common import (ChatTemplateFileOpt, CpuOnlyOpt, CtxOpt, CudaGraphsOpt, DeviceOpt, DraftOpt, DraftPMinOpt,
                     DryAllowedLengthOpt, DryBaseOpt, DryBreakerOpt, DryLastNOpt, DryMultiplierOpt, ExpertCacheOpt,
                     FrequencyPenaltyOpt, GrammarFileOpt, GrammarOpt, IgnoreEosOpt, JsonSchemaFileOpt, JsonSchemaOpt,
                     LogitBiasOpt, MinPOpt, ModelArg, ModelOpt, NCpuMoeOpt,
                     NGpuLayersOpt, OverrideTensorOpt, PcieShareOpt, SplitFfnOpt, PresencePenaltyOpt, ReasoningOpt,
                     RepeatLastNOpt, RepeatPenaltyOpt, SeedOpt, StopOpt, TempOpt, ThreadsOpt, TopKOpt, TopPOpt,
                     TypicalPOpt, VramOpt, XtcProbabilityOpt, XtcThresholdOpt, load_model, parse_reasoning,
                     grammar_option, pick_model, predict_limit, read_text_file, reasoning_with_grammar, sampler_extras,
                     check_sampling)
from .display import LiveStream, drive, stderr_console

INTERRUPTED = 130    # the shell's code for a run ended by Ctrl-C (128 + SIGINT)

DEMO_PROMPT = "def fibonacci(n):"


def read_prompt(prompt: Optional[str], file: Optional[Path], have_model: bool, stdin=None) -> str:
    """The prompt: -p, -f FILE, -f - (stdin), else text piped to stdin, else (bundled model only)
    the demo prompt."""
    stdin = sys.stdin if stdin is None else stdin
    if prompt is not None and file is not None:
        raise HybridError("give the prompt with -p or -f, not both")
    if file is not None and str(file) == "-":
        return _read_stdin(stdin)
    if file is not None:
        return read_text_file(file, "prompt file")
    if prompt is None:
        if _piped(stdin):
            text = _read_stdin(stdin)
            if text:
                return text
        if have_model:
            raise HybridError("no prompt: give one with -p TEXT, -f FILE or on stdin")
        return DEMO_PROMPT        # the bundled demo: `hybrid decode` alone shows the engine working
    return prompt


def _piped(stdin) -> bool:
    """stdin is a pipe or a file (not a terminal, not /dev/null or a closed descriptor)."""
    try:
        mode = os.fstat(stdin.fileno()).st_mode
    except (OSError, ValueError, AttributeError):
        return False
    return stat.S_ISFIFO(mode) or stat.S_ISREG(mode)


def _read_stdin(stdin) -> str:
    try:
        data = stdin.buffer.read() if hasattr(stdin, "buffer") else stdin.read()
    except OSError as e:
        raise HybridError(f"cannot read the prompt from stdin: {e.strerror}") from None
    if isinstance(data, bytes):
        try:
            return data.decode("utf-8")
        except UnicodeDecodeError:
            raise HybridError("the prompt on stdin is not UTF-8 text") from None
    return data


_ESCAPES = {"n": "\n", "t": "\t", "r": "\r", "\\": "\\", "'": "'", '"': '"', "a": "\a", "b": "\b",
            "f": "\f", "v": "\v", "0": "\0"}


def unescape(text: str) -> str:
    """llama.cpp's -e: \\n, \\t, \\\\, \\xHH … in the prompt become the characters (unknown escapes stay)."""
    def one(m):
        s = m.group(1)
        if s[0] == "x":
            return chr(int(s[1:], 16))
        return _ESCAPES.get(s, "\\" + s)
    return re.sub(r"\\(x[0-9a-fA-F]{2}|.)", one, text, flags=re.S)


def pick_draft(draft: Optional[str], has_mtp: bool) -> int:
    """The --draft value as a depth (its default: auto with an MTP head, else 0)."""
    return DraftPolicy.parse(draft, has_mtp).depth


def token_probs(m, prompt_ids: list[int], tokens: list[int], n: int) -> list[dict]:
    """Per generated token: its probability and the n likeliest tokens at its position, from
    the teacher-forced logits of prompt + generated text (what the model saw when sampling)."""
    if not tokens:
        return []
    logits = m.logits(list(prompt_ids) + tokens[:-1])[len(prompt_ids) - 1:]
    out = []
    for row, tok in zip(logits, tokens):
        p = np.exp(row.astype(np.float64) - row.max())
        p /= p.sum()
        top = np.argsort(-p, kind="stable")[:n]
        out.append({"id": tok, "text": m.tokenizer.decode([tok]), "prob": float(p[tok]),
                    "top": [{"id": int(i), "text": m.tokenizer.decode([int(i)]), "prob": float(p[i])} for i in top]})
    return out


@app.command("decode")
def decode(
    model: Optional[Path] = ModelArg,
    model_opt: Optional[Path] = ModelOpt,
    prompt: Optional[str] = typer.Option(None, "-p", "--prompt", help="Prompt text, used raw (no BOS unless the GGUF asks for one)."),
    file: Optional[Path] = typer.Option(None, "-f", "--file", help="Read the prompt from a UTF-8 file ('-': stdin). "
                                        "Without -p or -f, text piped to stdin is the prompt."),
    escape: bool = typer.Option(False, "--escape", "-e", help="Turn \\n, \\t, \\\\ … in the prompt into the characters (llama.cpp's -e)."),
    n_predict: int = typer.Option(128, "-n", "--n-predict",
                                  help="Tokens to generate at most (-1: no limit but the context, as -2)."),
    temp: float = TempOpt,
    top_k: int = TopKOpt,
    top_p: float = TopPOpt,
    min_p: float = MinPOpt,
    repeat_penalty: float = RepeatPenaltyOpt,
    repeat_last_n: int = RepeatLastNOpt,
    presence_penalty: float = PresencePenaltyOpt,
    frequency_penalty: float = FrequencyPenaltyOpt,
    typical_p: float = TypicalPOpt,
    xtc_probability: float = XtcProbabilityOpt,
    xtc_threshold: float = XtcThresholdOpt,
    dry_multiplier: float = DryMultiplierOpt,
    dry_base: float = DryBaseOpt,
    dry_allowed_length: int = DryAllowedLengthOpt,
    dry_penalty_last_n: int = DryLastNOpt,
    dry_breakers: List[str] = DryBreakerOpt,
    logit_bias: List[str] = LogitBiasOpt,
    grammar: Optional[str] = GrammarOpt,
    grammar_file: Optional[Path] = GrammarFileOpt,
    json_schema: Optional[str] = JsonSchemaOpt,
    json_schema_file: Optional[Path] = JsonSchemaFileOpt,
    seed: int = SeedOpt,
    threads: Optional[int] = ThreadsOpt,
    ctx_size: int = CtxOpt,
    chat: bool = typer.Option(False, "--chat", help="Wrap the prompt in the GGUF's chat template as a user turn."),
    system: Optional[str] = typer.Option(None, "--system", help="System message (implies --chat)."),
    chat_template_file: Optional[Path] = ChatTemplateFileOpt,
    reasoning: str = ReasoningOpt,
    stop: List[str] = StopOpt,
    ignore_eos: bool = IgnoreEosOpt,
    display_prompt: bool = typer.Option(True, "--display-prompt/--no-display-prompt",
                                        help="Echo a raw prompt before the generated text."),
    draft: Optional[str] = DraftOpt,
    draft_p_min: float = DraftPMinOpt,
    device: str = DeviceOpt,
    vram: Optional[str] = VramOpt,
    cpu_only: bool = CpuOnlyOpt,
    n_gpu_layers: Optional[str] = NGpuLayersOpt,
    n_cpu_moe: Optional[int] = NCpuMoeOpt,
    overrides: List[str] = OverrideTensorOpt,
    cuda_graphs: bool = CudaGraphsOpt,
    expert_cache: bool = ExpertCacheOpt,
    pcie_share: float = PcieShareOpt,
    split_ffn: bool = SplitFfnOpt,
    as_json: bool = typer.Option(False, "--json", help="Print one JSON object at the end and nothing else on stdout."),
    n_probs: int = typer.Option(0, "--n-probs", help="--json: for each generated token, the N most likely tokens "
                                "there and their probabilities (the model's softmax, before sampling)."),
) -> None:
    """Generate text from a prompt, with live speed.

    The text streams as it is made, beside the prefill and decode tokens/s.

    With no model and no prompt it runs the bundled tiny model on a demo prompt.
    """
    path = pick_model(model, model_opt)
    text = read_prompt(prompt, file, path is not None)
    if escape:
        text = unescape(text)
        system = unescape(system) if system is not None else None
    limit = predict_limit(n_predict)
    check_sampling(temp=temp, top_k=top_k, top_p=top_p, min_p=min_p, repeat_penalty=repeat_penalty,
                   seed=seed, repeat_last_n=repeat_last_n)
    DraftPolicy.parse(draft, True)          # a bad --draft fails before loading too
    # A system message only exists inside a chat template: --system (llama.cpp's -sys) turns it on.
    chat = chat or system is not None
    think = parse_reasoning(reasoning)
    extras = sampler_extras(typical_p, xtc_probability, xtc_threshold, dry_multiplier, dry_base, dry_allowed_length,
                            dry_penalty_last_n, dry_breakers, logit_bias)
    constraint = grammar_option(grammar, grammar_file, json_schema, json_schema_file)
    if chat:
        think = reasoning_with_grammar(think, constraint)
    if n_probs < 0:
        raise HybridError(f"--n-probs must be ≥ 0, got {n_probs}")
    if think is not None and not chat:
        raise HybridError("--reasoning applies to chat prompts: add --chat (a raw prompt has no template)")
    err = stderr_console()
    m = load_model(path, device=device, threads=threads, n_ctx=ctx_size, console=err, quiet=as_json,
                   vram=vram, cpu_only=cpu_only, overrides=overrides, cuda_graphs=cuda_graphs,
                   expert_cache=expert_cache, pcie_share=pcie_share, split_ffn=split_ffn, n_gpu_layers=n_gpu_layers,
                   n_cpu_moe=n_cpu_moe, chat_template_file=chat_template_file, draft=draft,
                   max_rows=lambda m: max(len(m.encode_prompt(text, chat=chat, system=system, reasoning=think)),
                                          DraftPolicy.parse(draft, m.has_mtp).ring))
    events = m.generate(text, max_tokens=m.n_ctx if limit is None else limit, temperature=temp, top_k=top_k, top_p=top_p, min_p=min_p,
                        repeat_penalty=repeat_penalty, repeat_last_n=repeat_last_n,
                        presence_penalty=presence_penalty, frequency_penalty=frequency_penalty,
                        seed=None if seed < 0 else seed, stop=stop, chat=chat, system=system, reasoning=think,
                        ignore_eos=ignore_eos, draft=pick_draft(draft, m.has_mtp), draft_p_min=draft_p_min,
                        grammar=constraint, **extras)
    if as_json:
        tokens, pieces, thoughts, final = [], [], [], {}

        def collect(ev):
            if isinstance(ev, Token):
                tokens.append(ev.id)
            if isinstance(ev, (Token, Done)):
                (thoughts if ev.reasoning else pieces).append(ev.text)
            if isinstance(ev, Done):
                final["stats"] = ev.stats
        drive(events, collect)
        out = {"model": str(m.path), "tokens": tokens, "text": "".join(pieces), **final["stats"].to_dict()}
        if chat:
            out["reasoning"] = "".join(thoughts)
        if n_probs:
            out["probs"] = token_probs(m, m.encode_prompt(text, chat=chat, system=system, reasoning=think),
                                       tokens, n_probs)
        sys.stdout.write(json.dumps(out, ensure_ascii=False) + "\n")
        stats = final["stats"]
    else:
        stats = LiveStream(Console()).run(events, prompt="" if chat or not display_prompt else text)
    if stats.stop_reason == "interrupted":
        raise typer.Exit(INTERRUPTED)
