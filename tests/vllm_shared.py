"""Helpers shared by the vLLM plugin tests on CPU (test_vllm_plugin.py) and GPU (gpu/test_vllm_plugin_gpu.py):
generate through vLLM with our seeded rule in the processor, and score the result with the trainer."""
import random

import torch

import trainer_patch
from rollout_service.vllm.requests import canonical_vllm_params, completion_tokens


def random_prompts(n, vocab, seed=0, lo=1, hi=40):
    rng = random.Random(seed)
    return [[rng.randrange(vocab) for _ in range(rng.randint(lo, hi))] for _ in range(n)]


def vllm_generate(llm, prompts, params, lora_request=None):
    """(tokens, log-probs, cached prompt tokens) per request; params are rollout_service.SamplingParams;
    lora_request: vLLM's, one for all or one per request."""
    vparams = [canonical_vllm_params(p, len(prompt), p.max_tokens) for prompt, p in zip(prompts, params)]
    outs = llm.generate([{"prompt_token_ids": list(p)} for p in prompts], vparams, lora_request=lora_request,
                        use_tqdm=False)
    return [(*completion_tokens(out.outputs[0]), out.num_cached_tokens or 0) for out in outs]


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
