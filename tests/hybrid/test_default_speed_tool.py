"""tools/default_speed.py `all`: the three parts of issue 29's table in one run, in the order that
keeps the cold start honest (the timing itself needs the machines)."""
from tools import default_speed as ds


def test_all_runs_start_then_load_then_depths_with_the_models_given(monkeypatch):
    calls = []
    monkeypatch.setattr(ds, "start", lambda a: calls.append(("start", a.tokens, a.devices)))
    monkeypatch.setattr(ds, "load", lambda a: calls.append(("load", a.model, a.busy)))
    monkeypatch.setattr(ds, "depths", lambda a: calls.append(("depths", a.model, a.paths, a.tokens, a.rounds,
                                                              a.model_tokens, a.model_rounds)))
    assert ds.main(["all", "--model", "27b.gguf", "--model", "35b.gguf", "--tokens", "64", "--rounds", "3",
                    "--model-rounds", "2"]) == 0
    assert calls == [("start", 64, "auto,cpu"), ("load", None, None),
                     ("depths", ["bundled", "27b.gguf", "35b.gguf"], "cpu,hybrid", 64, 3, 32, 2)]


def test_held_out_picks_the_depth_on_rounds_it_does_not_compare_on():
    """Depths 1 and 2 tied, each lucky on alternate rounds: picked on the even rounds, depth 1
    is compared on the odd ones, where it is unlucky; picking on all rounds would compare auto
    with whichever depth's luck was largest."""
    samples = {1: [110, 100, 110, 100, 110, 100], 2: [100, 105, 100, 105, 100, 105],
               "auto": [101, 101, 101, 101, 101, 101]}
    ratio, pick = ds.held_out(samples)
    assert pick == 1 and ratio == 101 / 100
