"""tools/depth_sim.py: the simulation's yardstick (auto ÷ the best fixed depth) must tell a
controller that finds the best depth from one that does not."""
import numpy as np

from tools import depth_sim


class Pinned:
    """A controller stuck at one depth."""
    def __init__(self, depth):
        self.depth = depth

    def __call__(self, max_depth):
        return self

    def choose(self):
        return self.depth

    def record(self, *args, **kwargs):
        pass


def test_a_controller_stuck_at_a_poor_depth_scores_below_one_found_at_the_best():
    scenario = depth_sim.SCENARIOS["gpu-flat"]
    costs, accept = scenario[0], scenario[1]
    run, tokens = 1.0, [1.0]                  # expected tokens of a step at depth 0..4
    for a in accept:
        run *= a
        tokens.append(tokens[-1] + run)
    rates = [t / c for t, c in zip(tokens, costs)]
    best, worst = int(np.argmax(rates)), int(np.argmin(rates))
    ratios = depth_sim.auto_over_best({"best": Pinned(best), "worst": Pinned(worst)}, scenario, seeds=3)
    assert 0.95 < np.mean(ratios["best"]) <= 1.05
    assert np.mean(ratios["worst"]) < rates[worst] / rates[best] + 0.05


def test_the_working_trees_controller_runs_every_scenario(capsys):
    assert depth_sim.main(["--seeds", "1"]) == 0
    out = capsys.readouterr().out
    for name in depth_sim.SCENARIOS:
        row = next(line for line in out.splitlines() if line.startswith(name))
        mean = float(row.split()[1])
        assert 0.5 < mean < 1.2
