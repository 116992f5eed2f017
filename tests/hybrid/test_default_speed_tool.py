"""tools/default_speed.py `all`: the three parts of issue 29's table in one run, in the order that
keeps the cold start honest (the timing itself needs the machines)."""
from tools import default_speed as ds


def test_all_runs_start_then_load_then_depths_with_the_models_given(monkeypatch):
    calls = []
    monkeypatch.setattr(ds, "start", lambda a: calls.append(("start", a.tokens, a.devices)))
    monkeypatch.setattr(ds, "load", lambda a: calls.append(("load", a.model, a.busy)))
    monkeypatch.setattr(ds, "depths", lambda a: calls.append(("depths", a.model, a.paths, a.tokens, a.rounds)))
    assert ds.main(["all", "--model", "27b.gguf", "--model", "35b.gguf", "--tokens", "64", "--rounds", "3"]) == 0
    assert calls == [("start", 64, "auto,cpu"), ("load", None, None),
                     ("depths", ["bundled", "27b.gguf", "35b.gguf"], "cpu,hybrid", 64, 3)]
