"""hybrid: GDN-hybrid LLM inference from GGUF files on CPU (+ GPU).

Importing this package needs neither a GPU nor a CUDA toolkit.
"""
__version__ = "0.1.0"

from .errors import HybridError, ModelError  # noqa: F401
