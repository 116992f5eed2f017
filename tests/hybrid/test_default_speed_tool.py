"""tools/default_speed.py `all`: the three parts of issue 29's table in one run, in the order that
keeps the cold start honest (the timing itself needs the machines)."""
from tools import default_speed as ds


def test_all_runs_start_then_load_then_oneshot_then_depths_with_the_models_given(monkeypatch):
    calls = []
    monkeypatch.setattr(ds, "start", lambda a: calls.append(("start", a.tokens, a.devices)))
    monkeypatch.setattr(ds, "load", lambda a: calls.append(("load", a.model, a.busy)))
    monkeypatch.setattr(ds, "oneshot", lambda a: calls.append(("oneshot", a.tokens, a.rounds, a.devices)))
    monkeypatch.setattr(ds, "depths", lambda a: calls.append(("depths", a.model, a.paths, a.tokens, a.rounds,
                                                              a.model_tokens, a.model_rounds, a.trace)))
    assert ds.main(["all", "--model", "27b.gguf", "--model", "35b.gguf", "--tokens", "64", "--rounds", "3",
                    "--model-rounds", "2", "--trace", "/tmp/t"]) == 0
    assert calls == [("start", 64, "auto,cpu"), ("load", None, None), ("oneshot", 64, 5, "auto,cpu"),
                     ("depths", ["bundled", "27b.gguf", "35b.gguf"], "cpu,hybrid", 64, 3, 32, 2, "/tmp/t")]


def test_oneshot_runs_a_process_a_run_and_only_the_remembered_auto_keeps_its_record(monkeypatch, capsys):
    """Each run gets a cache folder: a new empty one (deleted after it, so a name may come back),
    except `auto, remembered`, whose runs share one; rounds alternate the order; auto is compared
    with the best fixed depth's median."""
    runs = []
    speed = {"0": 100.0, "1": 200.0, "2": 150.0, "3": 120.0, "4": 110.0, "auto, fresh": 150.0, "auto, remembered": 190.0}

    def fake(device, mode, tokens, home):
        runs.append((device, mode, home))
        return speed[mode]
    monkeypatch.setattr(ds, "oneshot_speed", fake)
    assert ds.main(["oneshot", "--devices", "cuda", "--rounds", "3", "--tokens", "16"]) == 0
    modes = [m for _, m, _ in runs]
    assert modes == [*ds.ONESHOT_MODES, *ds.ONESHOT_MODES[::-1], *ds.ONESHOT_MODES]
    homes = {m: [h for _, mm, h in runs if mm == m] for m in ds.ONESHOT_MODES}
    assert len(set(homes["auto, remembered"])) == 1
    assert not set(homes["auto, fresh"]) & set(homes["auto, remembered"])
    assert "fresh 0.75, remembered 0.95" in capsys.readouterr().out


def test_held_out_picks_the_depth_on_rounds_it_does_not_compare_on():
    """Depths 1 and 2 tied, each lucky on alternate rounds: picked on the even rounds, depth 1
    is compared on the odd ones, where it is unlucky; picking on all rounds would compare auto
    with whichever depth's luck was largest."""
    samples = {1: [110, 100, 110, 100, 110, 100], 2: [100, 105, 100, 105, 100, 105],
               "auto": [101, 101, 101, 101, 101, 101]}
    ratio, pick = ds.held_out(samples)
    assert pick == 1 and ratio == 101 / 100
