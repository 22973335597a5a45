"""The engine's scheduler: admission, KV reservation and the typed plan of one step.

A step either prefills (prompt chunks under a token budget, at most G requests, oldest first) or
decodes (up to W tokens per running request). Reserving KV for a request may preempt younger ones,
so the oldest request always progresses; a preempted request is recomputed later with the same bits.
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Callable

from rollout_service.engine.config import EngineConfig
from rollout_service.engine.decode_policy import DecodePolicy
from rollout_service.engine.kv_cache import KVCache, OutOfBlocks
from rollout_service.engine.request import Request


@dataclass
class PrefillWork:
    req: Request
    num_tokens: int  # uncached tokens fed this step
    completes: bool  # the chunk reaches the last token: the next token is sampled


@dataclass
class DecodeWork:
    req: Request
    num_tokens: int  # tokens to decode (W, fewer near max_tokens or the model's length)
    verify: bool  # verified by DVR: proposed by the fast path, then checked in a verify window


@dataclass
class StepPlan:
    prefill: list[PrefillWork] = field(default_factory=list)
    decode: list[DecodeWork] = field(default_factory=list)
    strategy: str | None = None  # the decode policy's choice for this step's verified requests
    num_verified: int = 0


class Scheduler:
    """`release(req)` frees what a request holds outside the KV cache (the fast path's state)."""

    def __init__(self, cache: KVCache, cfg: EngineConfig, max_model_len: int, decode_policy: DecodePolicy,
                 release: Callable[[Request], None]):
        self.cache, self.max_model_len, self.decode_policy, self._release = cache, max_model_len, decode_policy, release
        self.window, self.group = cfg.window, cfg.group
        self.max_num_seqs, self.max_prefill_tokens = cfg.max_num_seqs, cfg.max_prefill_tokens
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.num_preemptions = 0  # requests whose KV was freed for an older one (recomputed later)

    def add(self, req: Request) -> None:
        self.waiting.append(req)

    def remove(self, request_id: int) -> Request | None:
        for queue in (self.waiting, self.running):
            for req in list(queue):
                if req.request_id == request_id:
                    queue.remove(req)
                    return req
        return None

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> StepPlan:
        """Prefill when some prefill can run, else decode: no step is ever idle."""
        self._admit()
        prefill = [r for r in self.running if r.needs_prefill]
        if prefill:
            work = self._plan_prefill(prefill)
            if work:
                return StepPlan(prefill=work)
        return self._plan_decode([r for r in self.running if not r.needs_prefill])

    def take_finished(self) -> list[Request]:
        done = [r for r in self.running if r.finish_reason]
        for req in done:
            self.running.remove(req)
        return done

    def _admit(self) -> None:
        while self.waiting and len(self.running) < self.max_num_seqs:
            req = self.waiting[0]
            if self.cache.blocks_for(len(req.tokens) + 1) > self.cache.free_blocks:
                break
            self.running.append(self.waiting.popleft())

    def _plan_prefill(self, reqs: list[Request]) -> list[PrefillWork]:
        budget = self.max_prefill_tokens
        work = []
        for req in sorted(reqs, key=lambda r: r.arrival):
            if budget <= 0 or len(work) == self.group or req not in self.running:
                break
            todo = len(req.tokens) - req.num_cached
            take = min(todo, budget)
            if not self._reserve(req, req.num_cached + take):
                break
            work.append(PrefillWork(req, take, take == todo))
            budget -= take
        return [w for w in work if w.req in self.running]  # a later reservation may preempt

    def _plan_decode(self, reqs: list[Request]) -> StepPlan:
        num_verified = sum(r.params.determinism.verifies for r in reqs)
        strategy = self.decode_policy.choose(num_verified) if num_verified else None
        work = []
        for req in sorted(reqs, key=lambda r: r.arrival):
            if req not in self.running:
                continue  # preempted while reserving for an earlier request
            room = min(req.remaining, self.max_model_len - len(req.tokens))
            dvr = req.params.determinism.verifies and strategy == "dvr"
            n = min(self.window, room - dvr)  # DVR leaves room for the verifier's own next token
            if self._reserve(req, len(req.tokens) + max(n, 1)):
                work.append(DecodeWork(req, n, dvr))
        return StepPlan(decode=[w for w in work if w.req in self.running], strategy=strategy,
                        num_verified=num_verified)

    def _reserve(self, req: Request, num_tokens: int) -> bool:
        """Blocks for num_tokens slots of req, preempting younger requests if needed; False if req has
        to wait."""
        while True:
            try:
                self.cache.ensure(req.block_ids, num_tokens)
                return True
            except OutOfBlocks:
                victims = [r for r in self.running if r.arrival > req.arrival and r.block_ids]
                if not victims:
                    return False
                self._preempt(max(victims, key=lambda r: r.arrival))

    def drop_all_kv(self) -> None:
        """Free every running request's KV (new weights: KV computed under others is never reused);
        each is prefilled again, prompt and generated tokens, before its next token."""
        for req in self.running:
            self._release(req)
            req.num_cached = 0

    def _preempt(self, req: Request) -> None:
        """Free req's KV; it is recomputed canonically (same bits) when it runs again."""
        self.num_preemptions += 1
        self._release(req)
        req.num_cached = 0
        self.running.remove(req)
        self.waiting.appendleft(req)
