"""A reward for verl's quick start on a random model: the share of digits in the response.

GSM8K's exact-answer reward is 0 for every response of a random model, so each GRPO group's advantages are 0, the
actor's gradient is 0 and its weights never change: every step would check the same weights. Random responses vary
in their share of digits, so with this reward the actor is updated at every step and each step's rollout runs on
the weights verl pushed after an optimizer step. verl loads it by `reward.custom_reward_function.{path,name}`.
"""


def compute_score(data_source, solution_str, ground_truth, extra_info=None, **kwargs) -> float:
    return sum(c.isdigit() for c in solution_str) / max(len(solution_str), 1)
