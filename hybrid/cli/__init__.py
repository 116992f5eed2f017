"""The `hybrid` command line. Each subcommand lives in its own module and registers itself."""
from __future__ import annotations

import sys

import typer

from ..errors import HybridError

app = typer.Typer(
    name="hybrid",
    help="Run GDN-hybrid LLMs (Qwen3.5/3.6, Qwen3.5-MoE, Qwen3-Next) from llama.cpp GGUF files, fast.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)

from . import info, make_model, bench_kernels, decode, bench, chat, serve  # noqa: E402,F401  (each adds its command)


def main() -> None:
    """Console entry point: user errors print one clear line and exit 1, never a traceback."""
    try:
        app()
    except HybridError as e:
        from rich.console import Console
        from rich.text import Text
        # a Text, not markup: messages quote shapes like [512, 1024] that markup would eat
        Console(stderr=True, soft_wrap=True).print(Text.assemble(("error: ", "bold red"), str(e)))
        sys.exit(1)
    except KeyboardInterrupt:
        sys.exit(130)
