"""`hybrid info` (being written)."""
