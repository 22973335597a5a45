"""Helpers shared by the vLLM plugin tests on CPU (test_vllm_plugin.py) and GPU (gpu/test_vllm_plugin_gpu.py):
generate through vLLM with our seeded rule in the processor, and score the result with the trainer."""
import random

import torch

import trainer_patch
from rollout_service.fast_path.vllm import EXTRA_ARGS_KEY


def random_prompts(n, vocab, seed=0, lo=1, hi=40):
    rng = random.Random(seed)
    return [[rng.randrange(vocab) for _ in range(rng.randint(lo, hi))] for _ in range(n)]


def vllm_generate(llm, prompts, params):
    """(tokens, log-probs, cached prompt tokens) per request; params are rollout_service.SamplingParams."""
    from vllm import SamplingParams as VSamplingParams
    vparams = [VSamplingParams(
        temperature=0.0, max_tokens=p.max_tokens, logprobs=0, ignore_eos=True, detokenize=False,
        extra_args={EXTRA_ARGS_KEY: dict(seed=p.effective_seed, temperature=float(p.temperature), top_k=p.top_k,
                                         top_p=float(p.top_p), position=len(prompt))})
        for prompt, p in zip(prompts, params)]
    outs = llm.generate([{"prompt_token_ids": list(p)} for p in prompts], vparams, use_tqdm=False)
    results = []
    for out in outs:
        c = out.outputs[0]
        tokens = list(c.token_ids)
        results.append((tokens, [c.logprobs[j][t].logprob for j, t in enumerate(tokens)], out.num_cached_tokens or 0))
    return results


def trainer_logprobs(policy, prompt, tokens, temperature):
    device = next(policy.parameters()).device
    ids = torch.tensor([list(prompt) + list(tokens)], device=device)
    with torch.no_grad():
        return trainer_patch.token_logprobs(policy, ids, temperature=temperature)[0, -len(tokens):].tolist()


def assert_matches_trainer(policy, prompts, params, results):
    for prompt, p, (tokens, logprobs, _) in zip(prompts, params, results):
        assert len(tokens) == p.max_tokens
        assert logprobs == trainer_logprobs(policy, prompt, tokens, p.temperature), (prompt, tokens)


def count_trainer_mismatches(policy, prompts, params, results) -> int:
    """Tokens whose log-prob differs from the trainer's (the negative controls' measure)."""
    return sum(a != b for prompt, p, (tokens, lps, _) in zip(prompts, params, results)
               for a, b in zip(lps, trainer_logprobs(policy, prompt, tokens, p.temperature)))
