"""Our requests in vLLM's terms and back: the vLLM SamplingParams that make vLLM emit the canonical
sampling rule's tokens and log-probs (canonical_vllm_params), and a vLLM completion's tokens and
log-probs (completion_tokens)."""
from __future__ import annotations

from rollout_service.vllm.plugin.sampling import EXTRA_ARGS_KEY


def canonical_vllm_params(params, num_preceding: int, max_tokens: int):
    """vLLM SamplingParams that make vLLM emit our rule's tokens and log-probs for a
    rollout_service.SamplingParams request whose first new token follows `num_preceding` tokens.
    Final output only: a per-step cumulative RequestOutput costs the engine loop a copy of every
    request's tokens and log-probs at every step (LLM.generate asks the same). Flat log-probs: the
    default layout allocates a dict and a Logprob per token, which sets off Python's garbage
    collector every step or two and, as they pile up, full collections that stall the engine
    loop (`bench.vllm_step_profile --timeline` counts them; bench/results/2026-11-27-h100-flat-logprobs)."""
    from vllm import SamplingParams as VSamplingParams
    from vllm.sampling_params import RequestOutputKind
    cfg = dict(seed=params.effective_seed, temperature=float(params.temperature), top_k=int(params.top_k),
               top_p=float(params.top_p), position=num_preceding)
    return VSamplingParams(temperature=0.0, max_tokens=max_tokens, logprobs=0, flat_logprobs=True, ignore_eos=True,
                           detokenize=False, stop_token_ids=list(params.stop_token_ids) or None,
                           extra_args={EXTRA_ARGS_KEY: cfg}, output_kind=RequestOutputKind.FINAL_ONLY)


def completion_tokens(completion) -> tuple[list[int], list[float]]:
    """(token ids, the log-prob vLLM reported for each) of a vLLM CompletionOutput, its log-probs in
    either layout: vLLM's FlatLogprobs (flat_logprobs=True) or a dict per position."""
    tokens = list(completion.token_ids)
    reported = completion.logprobs
    if reported is None or len(reported) != len(tokens):
        raise ValueError(f"vLLM reported log-probs for {0 if reported is None else len(reported)} of "
                         f"{len(tokens)} tokens; request them with logprobs=0")
    if hasattr(reported, "start_indices"):  # FlatLogprobs: read its lists, building no dict per position
        ids, values = reported.token_ids, reported.logprobs
        return tokens, [values[ids.index(t, start, end)]
                        for t, start, end in zip(tokens, reported.start_indices, reported.end_indices)]
    return tokens, [reported[j][t].logprob for j, t in enumerate(tokens)]
