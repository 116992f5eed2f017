"""The project's user-facing error, owned by the lowest layer so that the kernel libraries (cpu/,
gpu/) and the engine (hybrid/) raise the same class: its message is complete and meant for the
user, and the CLI prints it alone, never a traceback."""


class HybridError(Exception):
    """An error whose message is complete and meant for the user."""
