"""The rollout engine: continuous batching with decode-verify-rollback (DVR).

Each step reads as plan -> propose -> verify -> commit: the scheduler (scheduler.py) plans either a
prefill (canonically, chunked under a token budget) or a decode of up to W tokens per request; the
proposers are the fast path and the canonical decoder (fast_path/); the verifier (verifier.py) runs
the canonical forward and commits through Request.commit, the one place tokens are appended:
  * `verified`, decoded by DVR: the fast path proposes up to W tokens; the verifier replays the
    windows of G requests in one canonical forward, commits the matching prefix plus its own next
    token, and its KV overwrites the fast path's (same paged cache), which rolls the fast path back.
  * `invariant` (and `verified` when the decode policy finds it cheaper than DVR): W one-token steps
    of the canonical forward, committed as they are.
  * `off`: the fast path's tokens and log-probs are committed as they are.
Outputs are a pure function of (weights, prompt, params, seed) for verified and invariant requests.
"""
from __future__ import annotations

import itertools
import time

import torch

import kernels as K
from kernels.forward import CANONICAL_OPS, model_spec
from kernels.moe import capturable
from rollout_service.engine.adapters import AdapterTable
from rollout_service.engine.config import EngineConfig
from rollout_service.engine.cuda_graphs import GraphedModelRunner
from rollout_service.engine.decode_policy import DecodePolicy
from rollout_service.engine.decoder import WindowedDecoder
from rollout_service.engine.fast_path.base import DraftRequest, FastPath, Proposal
from rollout_service.engine.fast_path.native_ops import FAST_OPS
from rollout_service.engine.fast_path.registry import fast_path_factory
from rollout_service.engine.generate import generate_in_order
from rollout_service.engine.kv_cache import KVCache
from rollout_service.engine.model_loading import check_model_source, load_model
from rollout_service.engine.protocol import EngineCapabilities
from rollout_service.engine.request import Request
from rollout_service.engine.runner import ModelRunner
from rollout_service.engine.scheduler import DecodeWork, PrefillWork, Scheduler, StepPlan
from rollout_service.engine.verifier import Verifier, VerifyItem
from rollout_service.params import InvalidRequestError, Rollout, SamplingParams, check_request
from rollout_service.weight_digest import model_digest
from rollout_service.weights import copy_into, load_weights, weight_spec

# model_loading's and generate's functions are importable from here too, with the Engine they serve
__all__ = ["Engine", "check_model_source", "generate_in_order", "load_model"]


class Engine:
    """model: a model object, a checkpoint directory or "tiny:<arch>". Options: an EngineConfig and/or
    its fields as keywords (rollout_service.engine.config). runner_factory(model, cache, ops, device) ->
    runner replaces how a forward is executed (tensor parallelism)."""

    def __init__(self, model, config: EngineConfig | None = None, *, runner_factory=None, **options):
        self.config = cfg = EngineConfig.build(config, **options)
        self.device = torch.device(cfg.device)
        self.model = load_model(model, self.device, cfg.copy_model)
        self.spec = model_spec(self.model)
        self.window, self.group = cfg.window, cfg.group
        self.max_num_seqs = cfg.max_num_seqs
        self.max_model_len = cfg.max_model_len or self.spec.max_positions
        self.cache = KVCache(self.spec, -(-cfg.kv_cache_tokens // cfg.block_size), cfg.block_size, self.device)
        self.lora = AdapterTable(self.model, self.device, cfg.max_lora_rank)  # shared by every runner
        self._runner_factory = runner_factory
        self._cuda_graphs = cfg.cuda_graphs and runner_factory is None and self.device.type == "cuda"
        # canonical graphs: one-token steps of every running request, verify windows G at a time
        self.canonical_runner = self._make_runner(CANONICAL_OPS, {1: cfg.max_num_seqs, cfg.window + 1: cfg.group})
        self.fast_path = self._make_fast_path(cfg.fast_path, dict(cfg.fast_path_options))
        self.canonical_decoder = WindowedDecoder(self.canonical_runner, log_softmax=K.log_softmax)
        self.verifier = Verifier(self.canonical_runner, self.max_model_len)
        self.scheduler = Scheduler(self.cache, cfg, self.max_model_len, DecodePolicy(cfg.verified_decode),
                                   self._release)
        self.weight_version = 0  # what generated tokens are stamped with (see update_weights)
        self._ids = itertools.count()
        self._done: list[tuple[int, Rollout]] = []

    def _make_runner(self, ops, graph_shapes: dict[int, int]):
        """A runner for `ops`; on CUDA it replays graphs (graph_shapes: tokens per chunk -> max batch)."""
        if self._runner_factory is not None:
            runner = self._runner_factory(self.model, self.cache, ops, self.device)
            runner.adapters = self.lora.weights
            return runner
        # MoE layers whose experts are sized on the host (kernels/moe.py's loop) cannot be captured
        if self._cuda_graphs and (self.spec.moe is None or capturable(ops, self.device)):
            return GraphedModelRunner(self.model, self.cache, ops, self.device, max_batch=graph_shapes,
                                      max_model_len=self.max_model_len, adapters=self.lora.weights)
        return ModelRunner(self.model, self.cache, ops, self.device, self.lora.weights)

    def _make_fast_path(self, fast_path, options) -> FastPath:
        if fast_path == "native":
            return WindowedDecoder(self._make_runner(FAST_OPS, {1: self.max_num_seqs}))
        if isinstance(fast_path, str):
            return fast_path_factory(fast_path)(self.model, **options)
        return fast_path

    # ---- public API -------------------------------------------------------------------------
    def capabilities(self) -> EngineCapabilities:
        """update_weights between two steps with requests running is exact (the rule above it), so a
        pool may push in "switch-in-flight" mode (service/switch_modes.py); pushes arrive bucketed; MoE
        routing is recorded (by the canonical forward and the native fast path); sleep releases nothing
        (see sleep)."""
        return EngineCapabilities(switch_modes=True, routing_records=True, bucketed_push=True, sleep=False,
                                  lora_adapters=True)

    def add_request(self, prompt_token_ids, params: SamplingParams) -> int:
        """Queue a request; raises InvalidRequestError if it can never be served."""
        prompt, params = check_request(prompt_token_ids, params, self.spec.vocab_size, self.max_model_len)
        self.lora.check_request(params.adapter)
        if self.config.stock_only and params.determinism.runs_canonical:
            raise InvalidRequestError(f"determinism {params.determinism.value!r}: this engine serves only "
                                      "determinism='off' (stock_only=True)")
        need = self.cache.blocks_for(len(prompt) + params.max_tokens)
        if need > self.cache.num_blocks:
            raise InvalidRequestError(f"request can never fit: prompt + max_tokens needs {need} KV blocks, "
                                      f"the cache has {self.cache.num_blocks}")
        req = Request(next(self._ids), prompt, params, arrival=0)
        req.arrival = req.request_id
        self.scheduler.add(req)
        return req.request_id

    def abort(self, request_id: int) -> bool:
        req = self.scheduler.remove(request_id)
        if req is None:
            return False
        req.finish_reason = "abort"
        self._finish(req)
        return True

    @property
    def decode_policy(self) -> DecodePolicy:
        """How verified requests decode this step (the scheduler asks it, the engine reports timings)."""
        return self.scheduler.decode_policy

    @decode_policy.setter
    def decode_policy(self, policy: DecodePolicy) -> None:
        self.scheduler.decode_policy = policy

    @property
    def num_preemptions(self) -> int:
        """Requests whose KV was freed for an older one (recomputed later)."""
        return self.scheduler.num_preemptions

    def has_unfinished(self) -> bool:
        return self.scheduler.has_work() or bool(self._done)

    def step(self) -> list[tuple[int, Rollout]]:
        """One step: plan, propose, verify, commit; returns the requests that finished during it."""
        plan = self.scheduler.schedule()
        if plan.prefill:
            self._prefill(plan.prefill)
        elif plan.decode:
            self._decode(plan)
        for req in self.scheduler.running:  # weights change only between steps
            req.stamp(self.weight_version)
        for req in self.scheduler.take_finished():
            self._finish(req)
        done, self._done = self._done, []
        return done

    def generate(self, prompts, params, use_tqdm: bool = False) -> list[Rollout]:
        """Rollouts in request order; a request that cannot be served gets finish_reason 'error'."""
        return generate_in_order(self, prompts, params, use_tqdm)

    # Rule: weights may change between steps with requests running. Each generated token is stamped
    # with the version of the weights that produced it (Rollout.weight_versions), and KV computed under
    # other weights is never reused: a running request is prefilled again, prompt and generated tokens,
    # under the new weights before its next token, so that token's log-prob is the trainer's under its
    # version over the whole prefix.
    def update_weights(self, state_dict, expected_digest: str | None = None, version: int | None = None) -> str:
        """Load new weights (names and shapes must match, and the digest when one is expected; a refused
        push loads nothing and keeps the version); returns the content digest. version: the id later
        tokens are stamped with (default: the current one + 1)."""
        if version is not None and (isinstance(version, bool) or not isinstance(version, int)):
            raise TypeError(f"version must be an int, got {version!r}")
        digest = load_weights(self.model, state_dict, expected_digest)
        self.fast_path.update_weights(state_dict)
        self._new_version(version)
        return digest

    # LoRA adapters (engine/adapters.py). A replaced adapter is a new weight version, as a full push is:
    # running requests are prefilled again under it, so each token's log-prob is the trainer's.
    def load_adapter(self, name: str, adapter, expected_digest: str | None = None, version: int | None = None):
        if version is not None and (isinstance(version, bool) or not isinstance(version, int)):
            raise TypeError(f"version must be an int, got {version!r}")
        info = self.lora.load(name, adapter, expected_digest, self.weights_digest)
        self._new_version(version)
        return info

    def remove_adapter(self, name: str) -> None:
        running = [r.request_id for q in (self.scheduler.waiting, self.scheduler.running) for r in q
                   if r.params.adapter == name]
        if running:
            raise InvalidRequestError(f"adapter {name!r} is in use by requests {running[:5]}; abort them first")
        self.lora.remove(name)

    def adapters(self) -> dict:
        return dict(self.lora.info)

    def adapter(self, name: str):
        return self.lora.adapter(name)

    # bucketed pushes (rollout_service.service.weight_sync): tensors already checked against the sender's
    def weight_spec(self) -> dict[str, tuple[int, ...]]:
        return weight_spec(self.model)

    def load_named_weights(self, named) -> None:
        copy_into(self.model, named)

    def wait_host_copies(self) -> None:
        """Nothing to wait for: load_named_weights' copies are ordered on the caller's stream."""

    def finish_weight_load(self) -> None:
        self.fast_path.update_weights(self.model.state_dict())
        self._new_version(None)

    def _new_version(self, version: int | None) -> None:
        self.weight_version = self.weight_version + 1 if version is None else version
        self.scheduler.drop_all_kv()

    # The native engine's KV cache and graphs are allocated once and kept: sleep releases nothing
    # (a colocated native worker keeps its memory while the trainer steps; vLLM engines free theirs).
    def sleep(self) -> None:
        pass

    def wake_weights(self) -> None:
        pass

    def wake(self) -> None:
        pass

    def capture_graphs(self) -> int:
        """Capture all decode / verify-window CUDA graphs now rather than on first use (CUDA only)."""
        runners = (self.canonical_runner, getattr(self.fast_path, "runner", None))
        return sum(r.capture_all() for r in runners if isinstance(r, GraphedModelRunner))

    def weights_digest(self) -> str:
        return model_digest(self.model)

    def canonical_config(self) -> K.CanonicalConfig:
        """The contract this engine's canonical forward runs under (compared with the trainer's)."""
        return K.canonical_config(self.device)

    # ---- executing a plan ---------------------------------------------------------------------
    def _release(self, req: Request) -> None:
        self.cache.release(req.block_ids)
        self.fast_path.release(req.request_id)

    def _finish(self, req: Request) -> None:
        self._release(req)
        self._done.append((req.request_id, req.to_rollout()))

    def _prefill(self, work: list[PrefillWork]) -> None:
        self.verifier.run([VerifyItem(w.req, samples=w.completes, num_tokens=w.num_tokens) for w in work])

    def _decode(self, plan: StepPlan) -> None:
        start, before = time.perf_counter(), sum(len(w.req.tokens) for w in plan.decode)
        fast = [w for w in plan.decode if w.num_tokens > 0 and (w.verify or not w.req.params.determinism.runs_canonical)]
        canonical = [w for w in plan.decode if not w.verify and w.req.params.determinism.runs_canonical]
        proposals = {**self._propose(self.fast_path, fast), **self._propose(self.canonical_decoder, canonical)}
        windows = []
        for w in plan.decode:
            prop = proposals.get(w.req.request_id, Proposal([], []))
            if w.verify:
                windows.append(VerifyItem(w.req, prop.token_ids))
            else:  # off proposals and canonical steps are committed as they are
                w.req.num_cached = len(w.req.tokens) - 1 + len(prop.token_ids)
                w.req.commit(prop.token_ids, prop.logprobs, self.max_model_len, prop.routing)
        for first in range(0, len(windows), self.group):  # grouped verification: G windows per pass
            self.verifier.run(windows[first:first + self.group])
        if plan.strategy is not None:
            committed = sum(len(w.req.tokens) for w in plan.decode) - before
            self.decode_policy.record(plan.num_verified, plan.strategy, committed, time.perf_counter() - start)

    @staticmethod
    def _propose(decoder, work: list[DecodeWork]) -> dict[int, Proposal]:
        if not work:
            return {}
        outs = decoder.propose([DraftRequest(w.req.request_id, list(w.req.tokens), w.req.params, w.num_tokens,
                                             w.req.block_ids, len(w.req.prompt),
                                             w.req.params.return_routed_experts and not w.verify) for w in work])
        return {w.req.request_id: p for w, p in zip(work, outs)}
