"""`hybrid chat`: a multi-turn conversation in the terminal, each turn prefilling only new tokens."""
from __future__ import annotations

import itertools
import json
import sys
from pathlib import Path
from typing import List, Optional

import typer
from rich.console import Console
from rich.markup import escape
from rich.text import Text

from ..errors import HybridError
from ..events import Done, Token
from ..metadata import safe_text
from . import app
from .common import (ChatTemplateFileOpt, CpuOnlyOpt, CtxOpt, CudaGraphsOpt, DeviceOpt, DraftOpt, DraftPMinOpt,
                     DryAllowedLengthOpt, DryBaseOpt, DryBreakerOpt, DryLastNOpt, DryMultiplierOpt, ExpertCacheOpt,
                     FrequencyPenaltyOpt, GrammarFileOpt, GrammarOpt, IgnoreEosOpt, JsonSchemaFileOpt, JsonSchemaOpt,
                     LogitBiasOpt, MinPOpt, ModelArg, ModelOpt, NCpuMoeOpt,
                     NGpuLayersOpt, OverrideTensorOpt, PcieShareOpt, SplitFfnOpt, PresencePenaltyOpt, ReasoningOpt,
                     RepeatLastNOpt, RepeatPenaltyOpt, SeedOpt, StopOpt, TempOpt, ThreadsOpt, TopKOpt, TopPOpt,
                     TypicalPOpt, VramOpt, XtcProbabilityOpt, XtcThresholdOpt, load_model, parse_reasoning,
                     grammar_option, pick_model, predict_limit, reasoning_with_grammar, sampler_extras, check_sampling)
from .decode import pick_draft
from .display import LiveStream, drive, stderr_console

COMMANDS = {"/help": "list the commands", "/reset": "forget the conversation",
            "/save FILE": "write the conversation to FILE (JSON)", "/load FILE": "continue a saved conversation",
            "/exit": "quit (or Ctrl-D)"}
HELP = ("Enter sends a message. End a line with \\ to go on to the next one, or put \"\"\" alone on a "
        "line to start and end a multi-line message. Ctrl-C stops a reply, Ctrl-D quits.")


def read_messages(console: Console, interactive: bool):
    """User messages: a prompt per turn on a terminal (line editing and history through
    prompt_toolkit when it is installed; Ctrl-C clears the line), else one per line. Either
    way a line ending in \\ continues on the next, and lines between two \"\"\" lines are one
    message."""
    lines = _terminal_lines(console) if interactive else (line.rstrip("\n") for line in sys.stdin)
    for message in join_lines(lines):
        if message.strip():
            yield message


def join_lines(lines):
    """Group input lines into messages: `\\` at the end of a line continues it, a line holding
    only \"\"\" opens or closes a block kept as typed."""
    it = iter(lines)
    for line in it:
        if line.strip() == '"""':
            block = []
            for more in it:
                if more.strip() == '"""':
                    break
                block.append(more)
            yield "\n".join(block)
            continue
        parts = []
        while line.endswith("\\"):
            parts.append(line[:-1])
            line = next(it, "")
        parts.append(line)
        yield "\n".join(parts)


def _terminal_lines(console: Console):
    try:                       # prompt_toolkit is optional (line editing): deferred to the interactive path
        from prompt_toolkit import PromptSession
        from prompt_toolkit.history import InMemoryHistory
        session = PromptSession(history=InMemoryHistory())
        ask = lambda: session.prompt("> ")   # noqa: E731
    except ImportError:        # plain input: no editing keys beyond the terminal's own
        ask = lambda: console.input("[bold green]> [/]")   # noqa: E731
    while True:
        try:
            yield ask()
        except EOFError:
            console.print()
            return
        except KeyboardInterrupt:
            console.print("[dim](Ctrl-D or /exit to quit)[/]")
            continue


def save_conversation(session, file: str) -> None:
    data = {"system": session.system, "messages": session.messages}
    try:
        Path(file).write_text(json.dumps(data, ensure_ascii=False, indent=1) + "\n", encoding="utf-8")
    except OSError as e:
        raise HybridError(f"cannot write {file}: {e.strerror}") from None


def load_conversation(session, file: str) -> int:
    """Replace the conversation with a saved one (its system message too); the next turn
    prefills it. Returns the number of messages."""
    try:
        data = json.loads(Path(file).read_text(encoding="utf-8"))
    except OSError as e:
        raise HybridError(f"cannot read {file}: {e.strerror}") from None
    except (ValueError, UnicodeDecodeError):
        raise HybridError(f"{file} is not a saved conversation (JSON from /save)") from None
    messages = data.get("messages") if isinstance(data, dict) else None
    if not isinstance(messages, list) or not all(
            isinstance(m, dict) and m.get("role") in ("user", "assistant") and isinstance(m.get("content"), str)
            for m in messages):
        raise HybridError(f"{file} is not a saved conversation (JSON from /save)")
    session.reset()
    session.system = data.get("system") if isinstance(data.get("system"), str) else None
    session.messages = [{"role": m["role"], "content": m["content"]} for m in messages]
    return len(messages)


def run_command(message: str, session, err: Console) -> bool:
    """Carry out a /command; False for /exit. A line starting with / that is no command is
    refused, not sent to the model (start it with // to send a message that begins with /)."""
    name, _, arg = message.strip().partition(" ")
    name, arg = name.lower(), arg.strip()
    if name in ("/exit", "/quit"):
        return False
    if name == "/reset":
        session.reset()
        err.print("[dim](conversation cleared)[/]")
    elif name == "/help":
        for c, h in COMMANDS.items():
            err.print(f"  {c:<12} {h}", highlight=False, markup=False)
        err.print(HELP, highlight=False, markup=False)
    elif name in ("/save", "/load"):
        if not arg:
            raise HybridError(f"{name} needs a file name: {name} FILE")
        if name == "/save":
            save_conversation(session, arg)
            err.print(f"[dim](saved {len(session.messages)} messages to {arg})[/]", highlight=False)
        else:
            n = load_conversation(session, arg)
            err.print(f"[dim](loaded {n} messages from {arg})[/]", highlight=False)
    else:
        raise HybridError(f"unknown command {name}: /help lists them (start with // to send a message beginning with /)")
    return True


def turn_line(stats) -> Text:
    return Text(f"cached {stats.cached_tokens} tokens, prefilled {stats.prompt_tokens}", style="dim")


@app.command("chat")
def chat(
    model: Optional[Path] = ModelArg,
    model_opt: Optional[Path] = ModelOpt,
    system: Optional[str] = typer.Option(None, "--system", help="System message (llama.cpp's -sys)."),
    prompt: Optional[str] = typer.Option(None, "-p", "--prompt", help="The first user message (llama-cli's -p); "
                                         "more follow from the terminal or stdin unless --single-turn.",
                                         show_default=False),
    single_turn: bool = typer.Option(False, "-st", "--single-turn",
                                     help="Stop after the first reply (llama-cli's -st)."),
    chat_template_file: Optional[Path] = ChatTemplateFileOpt,
    reasoning: str = ReasoningOpt,
    n_predict: int = typer.Option(512, "-n", "--n-predict",
                                  help="Tokens per reply at most (-1: no limit but the context, as -2)."),
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
    stop: List[str] = StopOpt,
    ignore_eos: bool = IgnoreEosOpt,
    threads: Optional[int] = ThreadsOpt,
    ctx_size: int = CtxOpt,
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
    as_json: bool = typer.Option(False, "--json", help="One JSON object per reply on stdout (JSON Lines), nothing else."),
) -> None:
    """Chat with a model.

    The conversation stays in the model's state between turns, so each turn only prefills what
    is new. /help lists the commands (/reset, /save, /load, /exit); Ctrl-D quits, Ctrl-C stops
    a reply. End a line with \\ to continue it, or wrap lines in \"\"\".

    With stdin not a terminal, every line is one user message (replies go to stdout).
    """
    limit = predict_limit(n_predict)
    if prompt is not None and not prompt.strip():
        raise HybridError("the first message (-p) is empty")
    check_sampling(temp=temp, top_k=top_k, top_p=top_p, min_p=min_p, repeat_penalty=repeat_penalty, seed=seed,
                   repeat_last_n=repeat_last_n)
    pick_draft(draft, True)                 # a bad --draft fails before loading too
    think = parse_reasoning(reasoning)
    extras = sampler_extras(typical_p, xtc_probability, xtc_threshold, dry_multiplier, dry_base, dry_allowed_length,
                            dry_penalty_last_n, dry_breakers, logit_bias)
    constraint = grammar_option(grammar, grammar_file, json_schema, json_schema_file)
    think = reasoning_with_grammar(think, constraint)
    err = stderr_console()
    interactive = sys.stdin.isatty()
    m = load_model(pick_model(model, model_opt), device=device, threads=threads, n_ctx=ctx_size, console=err,
                   vram=vram, cpu_only=cpu_only, overrides=overrides, cuda_graphs=cuda_graphs,
                   expert_cache=expert_cache, pcie_share=pcie_share, split_ffn=split_ffn, n_gpu_layers=n_gpu_layers,
                   n_cpu_moe=n_cpu_moe, chat_template_file=chat_template_file, quiet=as_json,
                   draft=draft)
    session = m.session(system=system, n_ctx=ctx_size, draft=pick_draft(draft, m.has_mtp), draft_p_min=draft_p_min,
                        reasoning=think)
    sampling = dict(max_tokens=session.n_ctx if limit is None else limit, temperature=temp, top_k=top_k,
                    top_p=top_p, min_p=min_p, repeat_penalty=repeat_penalty, repeat_last_n=repeat_last_n,
                    presence_penalty=presence_penalty, frequency_penalty=frequency_penalty,
                    seed=None if seed < 0 else seed, stop=stop, ignore_eos=ignore_eos, grammar=constraint, **extras)
    out = Console()
    if interactive:
        err.print(f"[dim]{escape(safe_text(m.path.name))} · /help for commands · Ctrl-D quits[/]", highlight=False)
    failed = 0
    messages = read_messages(err, interactive)      # (read lazily: a single turn from -p reads nothing)
    for message in itertools.chain([prompt] if prompt is not None else [], messages):
        try:
            if message.startswith("/") and not message.startswith("//"):
                if not run_command(message, session, err):
                    break
                continue
            if message.startswith("//"):
                message = message[1:]
            events = session.send(message, **sampling)
            if as_json:
                stats = _json_turn(events)
            else:
                stats = LiveStream(out).run(events)
        except HybridError as e:
            # one bad turn (a line too long for the context) is reported and the conversation
            # goes on with the next line; a script still sees the failure in the exit status
            err.print(Text.assemble(("error: ", "bold red"), safe_text(str(e), 2000)), soft_wrap=True)
            failed += 1
        except KeyboardInterrupt:     # landed outside the generation loop: the turn is dropped
            err.print("[dim](interrupted)[/]")
        else:
            if not as_json:
                (out if out.is_terminal else err).print(turn_line(stats))    # under that turn's summary
        if single_turn:
            break
    if failed and not interactive:
        raise typer.Exit(1)


def _json_turn(events):
    """One reply as one JSON line: the answer's text, the reasoning apart, the turn's stats."""
    tokens, pieces, thoughts, final = [], [], [], {}

    def collect(ev):
        if isinstance(ev, Token):
            tokens.append(ev.id)
        if isinstance(ev, (Token, Done)):
            (thoughts if ev.reasoning else pieces).append(ev.text)
        if isinstance(ev, Done):
            final["stats"] = ev.stats
    drive(events, collect)
    stats = final["stats"]
    sys.stdout.write(json.dumps({"tokens": tokens, "text": "".join(pieces), "reasoning": "".join(thoughts),
                                 **stats.to_dict()}, ensure_ascii=False) + "\n")
    sys.stdout.flush()
    return stats
