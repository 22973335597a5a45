"""bench.grpo_step's figure: each arm's step split, and a reward panel only where a curve is as long as the
smoothing window (a two-step run has no smoothed point, so it gets the split alone, not an empty panel)."""
import matplotlib.image

from bench.grpo_arms.plot import plot
from bench.grpo_arms.summary import REWARD_WINDOW
from recipes.metrics import STEP_PARTS


def _result(steps: int) -> dict:
    arm = {f"{part}_s": 1.0 for part in STEP_PARTS}
    arm.update(step_s=len(STEP_PARTS) + 0.5, reward_curve=[[float(i), 0.1 * i] for i in range(steps)])
    return {"config": "recipes/configs/tiny.yaml", "rounds": [{"order": ["canonical"], "canonical": arm}]}


def test_a_short_run_gets_the_split_alone_and_a_long_one_the_reward_panel_too(tmp_path):
    widths = {}
    for steps in (REWARD_WINDOW - 1, REWARD_WINDOW + 2):
        path = tmp_path / f"{steps}.png"
        plot(_result(steps), str(path))
        widths[steps] = matplotlib.image.imread(path).shape[1]
    # one panel is 6 inches at 120 dpi (tight_layout trims a few pixels); a second adds 6 more
    assert widths[REWARD_WINDOW - 1] <= 6 * 120 < widths[REWARD_WINDOW + 2]
