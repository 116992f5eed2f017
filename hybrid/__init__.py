"""hybrid: GDN-hybrid LLM inference from GGUF files on CPU (+ GPU).

Importing this package needs neither a GPU nor a CUDA toolkit.
"""
__version__ = "0.1.0"

from .errors import HybridError, ModelError  # noqa: F401
from .events import Done, Prefill, Stats, Token  # noqa: F401  (what generate() yields)


def load(path=None, device="auto", threads=None, n_ctx=None, **placement):
    """Open a GGUF model and return a `hybrid.api.Model` (see `hybrid.api.load`)."""
    from .api import load as _load    # deferred: hybrid.api loads numba and numba.cuda; `import hybrid` stays light
    return _load(path, device=device, threads=threads, n_ctx=n_ctx, **placement)
