"""User-facing errors: the CLI prints their message alone, never a traceback."""


class HybridError(Exception):
    """An error whose message is complete and meant for the user."""


class ModelError(HybridError):
    """The model file cannot be used (missing, not GGUF, truncated, unsupported, inconsistent)."""
