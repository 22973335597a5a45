"""The native engine's batched decoder over its own paged KV cache, in windows of tokens.

One class, two roles, told apart by the runner's ops. With ordinary torch ops (FAST_OPS) it is the
native fast path: it samples with the same seeded Gumbel rule as the verifier, so its proposals
agree whenever the fast logits pick the same token. Over the verifier's runner (canonical ops,
canonical log_softmax) it is the canonical decoder: its tokens and log-probs are the trainer's.
"""
from __future__ import annotations

import torch

from kernels import sampling_position
from kernels.forward import model_spec
from rollout_service.engine.fast_path.base import DraftRequest, Proposal
from rollout_service.engine.runner import Chunk, ModelRunner
from rollout_service.engine.sampler import sample_rows, token_logprobs_at


class WindowedDecoder:
    """Windowed decoding over a runner: the native fast path (FAST_OPS) or the canonical decoder
    (the verifier's runner and K.log_softmax); see the module docstring."""
    name = "native"

    def __init__(self, runner: ModelRunner, log_softmax=None):
        self.runner = runner  # a runner over the engine's KV cache
        self.log_softmax = log_softmax or (lambda x: torch.log_softmax(x, dim=-1))
        self.moe = model_spec(runner.model).moe is not None

    def propose(self, batch: list[DraftRequest]) -> list[Proposal]:
        """Up to r.num_tokens tokens per request. Sampled tokens stay on the device and feed the next
        step directly, so the host queues steps ahead of the GPU; one readback at the end."""
        if not batch:
            return []
        dev = self.runner.device
        lengths = [len(r.token_ids) for r in batch]
        last = torch.tensor([r.token_ids[-1] for r in batch]).to(dev, non_blocking=True)  # fed token per request
        record = self.moe and any(r.record_routing for r in batch)  # no cost otherwise
        steps = []  # (live request indices, sampled tokens, their log-probs, expert ids) per step
        for step in range(max(r.num_tokens for r in batch)):
            live = [i for i, r in enumerate(batch) if r.num_tokens > step]
            chunks = [Chunk([0], lengths[i] + step - 1, batch[i].block_ids, 1, batch[i].params.adapter)
                      for i in live]  # ids: `feed`
            index = None if len(live) == len(batch) else torch.tensor(live).to(dev, non_blocking=True)
            feed = last if index is None else last[index]
            routing = [] if record else None
            logits = torch.cat(self.runner.forward(chunks, token_ids=feed, routing=routing))
            params = [batch[i].params for i in live]
            tokens = sample_rows(logits, params, [sampling_position(lengths[i] + step) for i in live])
            logps = token_logprobs_at(logits, params, tokens, self.log_softmax)
            last = tokens if index is None else last.index_copy(0, index, tokens)
            steps.append((live, tokens, logps, torch.cat(routing) if record else None))
        out = [Proposal([], [], [] if record else None) for _ in batch]
        all_tokens = torch.cat([s[1] for s in steps]).tolist()
        all_logps = torch.cat([s[2] for s in steps]).tolist()
        # one readback for the routing too: [tokens][moe_layers][k]
        all_routing = torch.cat([s[3] for s in steps]).tolist() if record else None
        flat = [i for live, *_ in steps for i in live]
        for j, (i, tok, lp) in enumerate(zip(flat, all_tokens, all_logps)):
            out[i].token_ids.append(tok)
            out[i].logprobs.append(lp)
            if record:
                out[i].routing.append(all_routing[j])
        return out

    def release(self, request_id: int) -> None:
        pass  # all state lives in the engine's KV cache

    def update_weights(self, state_dict) -> None:
        pass  # shares the engine's model
