"""The parts of `python -m bench.grpo_step`: the arms and how they run, their summaries, the paired
ratios, and the plots."""
