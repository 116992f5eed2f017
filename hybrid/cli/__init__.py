"""The `hybrid` command line. Each subcommand lives in its own module and registers itself."""
from __future__ import annotations

import sys

import typer
from rich.console import Console
from rich.text import Text

from .. import __version__
from ..errors import HybridError
from ..metadata import safe_text
from .llama_flags import rewrite, stderr_note, version_requested

app = typer.Typer(
    name="hybrid",
    help="Run GDN-hybrid LLMs (Qwen3.5/3.6, Qwen3.5-MoE, Qwen3-Next) from llama.cpp GGUF files, fast.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    # plain help, as llama.cpp's: rich's six-column option table leaves the help text ~15
    # characters at 80 columns
    rich_markup_mode=None,
)

from . import info, make_model, bench_kernels, decode, bench, chat, serve  # noqa: E402,F401  (each adds its command)


MAX_ERROR_CHARS = 2000


def main() -> None:
    """Console entry point: user errors print one clear line and exit 1, never a traceback.

    argv is rewritten first so llama.cpp's spellings (-ngl, -fa, -sys, …) mean what a llama.cpp
    user expects instead of being read as bundled one-letter options (llama_flags)."""
    try:
        argv = sys.argv[1:]
        if version_requested(argv):
            sys.stdout.write(f"hybrid {__version__}\n")
            return
        app(args=rewrite(argv, stderr_note), prog_name="hybrid")
    except HybridError as e:
        # a Text, not markup: messages quote shapes like [512, 1024] that markup would eat; and
        # escaped and cut, since messages quote file-derived text (the last line of defence:
        # readers already pass such text through safe_text)
        Console(stderr=True, soft_wrap=True).print(
            Text.assemble(("error: ", "bold red"), safe_text(str(e), MAX_ERROR_CHARS)))
        sys.exit(1)
    except KeyboardInterrupt:
        sys.exit(130)
