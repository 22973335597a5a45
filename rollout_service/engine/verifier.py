"""The verifier: one canonical forward over up to G requests, the seeded sampling rule on its
logits, and the commit of what it accepts.

Each item feeds a request's uncached tokens (a prefill chunk, or the last committed token of a
decode step) plus the fast path's proposals. For a sampling item every position is sampled: the
proposals the verifier agrees with are committed together with its own next token (a rejected
proposal and everything after it are rolled back: the verifier's KV overwrites the fast path's).
When a request asks for its MoE routing (return_routed_experts), each committed token carries the
expert ids of the verifier row that sampled it.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

import kernels as K
from kernels.forward import model_spec
from rollout_service.engine.request import Request
from rollout_service.engine.runner import Chunk
from rollout_service.engine.sampler import sample_rows, token_logprobs_at


@dataclass
class VerifyItem:
    req: Request
    proposals: list[int] = field(default_factory=list)  # tokens after req.tokens to check
    samples: bool = True  # False: a prefill chunk that ends mid-prompt (KV only)
    num_tokens: int | None = None  # uncached tokens to feed; None: all of them (a decode window)

    @property
    def is_window(self) -> bool:
        return self.num_tokens is None


class Verifier:
    def __init__(self, runner, max_model_len: int):
        self.runner, self.max_model_len = runner, max_model_len
        self.moe = model_spec(runner.model).moe is not None  # dense models have no routing to record

    def run(self, items: list[VerifyItem]) -> None:
        chunks = []
        for it in items:
            req = it.req
            end = len(req.tokens) if it.num_tokens is None else req.num_cached + it.num_tokens
            fed = req.tokens[req.num_cached:end]
            chunks.append(Chunk(fed + it.proposals, req.num_cached, req.block_ids,
                                len(it.proposals) + 1 if it.samples else 0, req.params.adapter))
        record = self.moe and any(it.req.params.return_routed_experts for it in items)
        routing = [] if record else None
        logits = self.runner.forward(chunks, routing=routing)
        rows, params, positions = [], [], []
        for it, lg in zip(items, logits):
            rows.append(lg)
            params += [it.req.params] * lg.shape[0]
            positions += K.sampling_positions(len(it.req.tokens), lg.shape[0])
        tokens = logps = None
        if sum(lg.shape[0] for lg in rows):
            all_logits = torch.cat(rows)
            sampled = sample_rows(all_logits, params, positions)
            logps = token_logprobs_at(all_logits, params, sampled, K.log_softmax).tolist()
            tokens = sampled.tolist()  # one device-to-host copy per pass
            if record:
                routing = torch.cat(routing).tolist()  # [rows][moe_layers][k], one copy per pass
        offset = 0
        for it, chunk in zip(items, chunks):
            req = it.req
            if not it.samples:
                req.num_cached += len(chunk.token_ids)
                continue
            n = len(it.proposals)
            canon, canon_lp = tokens[offset:offset + n + 1], logps[offset:offset + n + 1]
            experts = routing[offset:offset + n + 1] if record else None
            offset += n + 1
            accepted = next((i for i in range(n) if canon[i] != it.proposals[i]), n)
            if it.is_window and req.params.determinism.verifies:
                req.stats.verify_windows += 1
                req.stats.proposed_tokens += n
                req.stats.accepted_tokens += accepted
                if accepted < n:
                    req.stats.rollbacks += 1
                    req.stats.recomputed_tokens += n - accepted
            req.num_cached = len(req.tokens) + accepted
            req.commit(canon[:accepted + 1], canon_lp[:accepted + 1], self.max_model_len,
                       experts[:accepted + 1] if record else None)
