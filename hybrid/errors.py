"""User-facing errors: the CLI prints their message alone, never a traceback."""
from cpu.errors import HybridError


class ModelError(HybridError):
    """The model file cannot be used (missing, not GGUF, truncated, unsupported, inconsistent)."""


__all__ = ["HybridError", "ModelError"]
