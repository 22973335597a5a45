"""vLLM as the native engine's fast path: a VLLMInstance on the same checkpoint proposes windows of
`max_tokens=W` tokens, sampled by our seeded rule inside vLLM (vllm.plugin.sampling: vLLM greedy over
the one finite logit the rule leaves, the rule's log-prob reported); the engine's verifier decides
what is committed.

Rollback needs no state: the next window resubmits prompt + committed tokens and prefix caching
reuses the KV.
"""
from __future__ import annotations

from rollout_service.engine.fast_path.base import DraftRequest, Proposal
from rollout_service.vllm.instance import VLLMInstance
from rollout_service.vllm.requests import canonical_vllm_params, completion_tokens


class VLLMProposer:
    """The FastPath protocol (engine.fast_path.base) on a VLLMInstance built from `model` with
    `options` (VLLMInstance's)."""

    name = "vllm"

    def __init__(self, model, **options):
        self.instance = VLLMInstance(model, **options)

    def propose(self, batch: list[DraftRequest]) -> list[Proposal]:
        prompts, params, slots = [], [], []
        proposals = [Proposal([], []) for _ in batch]
        limit = self.instance.max_model_len
        for i, r in enumerate(batch):
            n = min(r.num_tokens, limit - len(r.token_ids))
            if n <= 0:
                continue
            prompts.append(self.instance.prompt(list(r.token_ids)))
            params.append(canonical_vllm_params(r.params, len(r.token_ids), n))
            slots.append(i)
        if not prompts:
            return proposals
        outputs = self.instance.llm.generate(prompts, params, use_tqdm=False)
        for i, out in zip(slots, outputs):
            proposals[i] = Proposal(*completion_tokens(out.outputs[0]))
        return proposals

    def release(self, request_id: int) -> None:
        """Nothing to free: vLLM's prefix cache keeps (and evicts) the KV of resubmitted prefixes."""

    def update_weights(self, state_dict) -> None:
        self.instance.update_weights(state_dict)

    def capture(self, on: bool = True) -> list[dict]:
        """What the sampling rule saw for each proposed token (VLLMInstance.capture)."""
        return self.instance.capture(on)

    def close(self) -> None:
        self.instance.close()
