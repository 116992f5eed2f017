"""`hybrid make_model` (being written)."""
