"""`hybrid serve`: an OpenAI-compatible HTTP server (hybrid/server) over one loaded model."""
from __future__ import annotations

import logging
import socket
import sys
from pathlib import Path
from typing import List, Optional

import typer
from rich.console import Console

from ..draft_policy import DraftPolicy
from ..errors import HybridError
from ..server.engine import Engine
from ..units import parse_size
from . import app
from .common import (CpuOnlyOpt, CtxOpt, CudaGraphsOpt, DeviceOpt, DraftOpt, DraftPMinOpt, ExpertCacheOpt,
                     ModelArg, ModelOpt, NCpuMoeOpt, NGpuLayersOpt, OverrideTensorOpt, PcieShareOpt, SplitFfnOpt, ThreadsOpt,
                     VramOpt, load_model, pick_model)


@app.command("serve")
def serve(
    model: Optional[Path] = ModelArg,
    model_opt: Optional[Path] = ModelOpt,
    host: str = typer.Option("127.0.0.1", "--host", help="Address to listen on (0.0.0.0: every interface; "
                             "then set --api-key)."),
    port: int = typer.Option(8080, "--port", min=0, max=65535, help="TCP port (0: any free one)."),
    api_key: Optional[str] = typer.Option(None, "--api-key", help="Require 'Authorization: Bearer KEY' "
                                          "(every endpoint but /health).", show_default=False),
    alias: Optional[str] = typer.Option(None, "-a", "--alias", help="The model's name in /v1/models and in "
                                        "responses, as llama-server's (default: the GGUF's file name). "
                                        "Requests may give any 'model': this server has one.",
                                        show_default=False),
    cache_mem: str = typer.Option("8GiB", "--cache-mem", help="Host memory for saved conversation states, "
                                  "as llama-server's --cache-ram (0 = off: every request prefills its whole "
                                  "prompt)."),
    max_queue: int = typer.Option(16, "--max-queue", min=0, help="Requests that may wait while one runs; "
                                  "beyond that the server answers 503."),
    max_tokens: int = typer.Option(4096, "--max-tokens", min=1, help="The most tokens one request may "
                                   "generate (also the default when it does not say)."),
    max_body: str = typer.Option("4MiB", "--max-body", help="Largest request body; larger gets 413."),
    threads: Optional[int] = ThreadsOpt,
    ctx_size: int = CtxOpt,
    draft: Optional[str] = DraftOpt,
    draft_p_min: float = DraftPMinOpt,
    device: str = DeviceOpt,
    vram: Optional[str] = VramOpt,
    cpu_only: bool = CpuOnlyOpt,
    overrides: List[str] = OverrideTensorOpt,
    cuda_graphs: bool = CudaGraphsOpt,
    expert_cache: bool = ExpertCacheOpt,
    pcie_share: float = PcieShareOpt,
    split_ffn: bool = SplitFfnOpt,
    n_gpu_layers: Optional[str] = NGpuLayersOpt,
    n_cpu_moe: Optional[int] = NCpuMoeOpt,
) -> None:
    """Serve the model over an OpenAI-compatible HTTP API.

    Chat, completions, streaming and tool calls.

    Each conversation's state is kept between requests, so a new turn prefills only its new tokens.
    """
    # the server stack (uvicorn, starlette) only for `hybrid serve`: every other command starts without it
    import uvicorn

    from ..server.app import Limits, build_app

    path = pick_model(model, model_opt)
    cache_bytes = parse_size(cache_mem, "state cache size (--cache-mem)")
    body_bytes = parse_size(max_body, "request size limit (--max-body)")
    err = Console(stderr=True)
    m = load_model(path, device=device, threads=threads, n_ctx=ctx_size, console=err, vram=vram,
                   cpu_only=cpu_only, overrides=overrides, cuda_graphs=cuda_graphs, expert_cache=expert_cache,
                   pcie_share=pcie_share, split_ffn=split_ffn, n_gpu_layers=n_gpu_layers, n_cpu_moe=n_cpu_moe, max_rows=None,
                   draft=draft)
    DraftPolicy.parse(draft, m.has_mtp)        # a bad --draft fails before the port opens
    engine = Engine(m, draft=draft, draft_p_min=draft_p_min, cache_bytes=cache_bytes, max_queue=max_queue)
    model_id = alias or m.path.name
    web = build_app(m, engine, Limits(max_body=body_bytes, max_tokens=max_tokens, api_key=api_key), model_id)
    try:                                        # bind here so a taken port is one clear line
        sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
    except OSError as e:
        raise HybridError(f"cannot listen on {host}:{port}: {e.strerror}") from None
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    if api_key is None and host not in ("127.0.0.1", "localhost", "::1"):
        err.print(f"warning: listening on {host} without --api-key: anyone who can reach it can use it",
                  style="yellow", highlight=False)
    bound = sock.getsockname()[1]
    # the test harness and scripts read this line to learn the port (with --port 0)
    print(f"hybrid serve: listening on http://{host}:{bound} (model {model_id}, context {m.n_ctx})",
          file=sys.stderr, flush=True)
    config = uvicorn.Config(web, log_level="warning", timeout_graceful_shutdown=2)
    try:
        uvicorn.Server(config).run(sockets=[sock])
    finally:
        engine.close()
