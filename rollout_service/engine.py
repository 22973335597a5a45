"""The rollout engine: continuous batching with decode-verify-rollback (DVR).

Per step the engine either prefills (canonically, chunked under a token budget) or decodes up to W
tokens per request:
  * `verified`, decoded by DVR: the fast path proposes up to W tokens; the verifier replays the
    windows of G requests in one canonical forward, commits the matching prefix plus its own next
    token, and its KV overwrites the fast path's (same paged cache), which rolls the fast path back.
  * `invariant` (and `verified` when the decode policy finds it cheaper than DVR): W one-token steps
    of the canonical forward, committed as they are.
  * `off`: the fast path's tokens and log-probs are committed as they are.
Outputs are a pure function of (weights, prompt, params, seed) for verified and invariant requests.
"""
from __future__ import annotations

import copy
import itertools
import time
from collections import deque
from pathlib import Path

import torch

import kernels as K
from kernels.forward import CANONICAL_OPS, model_spec

from .decode_policy import DecodePolicy
from .fast_path.base import DraftRequest, FastPath, Proposal
from .fast_path.native import NativeFastPath, sample_rows, token_logprobs_at
from .fast_path.native_ops import FAST_OPS
from .kv_cache import KVCache, OutOfBlocks
from .params import InvalidRequestError, Rollout, SamplingParams, check_params, check_prompt
from .config import EngineConfig
from .cuda_graphs import GraphedModelRunner
from .request import Request
from .tiny_models import ARCHITECTURES, TINY_PREFIX, tiny_model
from .runner import Chunk, ModelRunner
from .weights import load_weights, model_digest


def load_model(model, device, copy_model: bool = True) -> torch.nn.Module:
    """An HF causal LM as a bf16 inference model on `device`.

    `model`: a model object, a local checkpoint directory, or "tiny:{llama,qwen2,qwen3}" (a tiny
    random model, rollout_service.tiny_models; the same names everywhere: Engine, workers, the audit).
    """
    if isinstance(model, str) and model.startswith(TINY_PREFIX):
        model = tiny_model(model[len(TINY_PREFIX):])
    elif isinstance(model, (str, Path)):
        path = Path(model)
        if not path.is_dir():
            raise FileNotFoundError(f"model path {str(model)!r} is not a local directory "
                                    f"(no model hub is contacted; pass a saved checkpoint, "
                                    f"{TINY_PREFIX}<{'|'.join(ARCHITECTURES)}> or a model object)")
        import transformers
        model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16)
    elif not isinstance(model, torch.nn.Module):
        raise TypeError(f"model must be a Hugging Face model or a local path, got {type(model).__name__}")
    elif copy_model:
        model = copy.deepcopy(model)
    model_spec(model)  # supported architecture?
    return model.to(device=device, dtype=torch.bfloat16).eval().requires_grad_(False)


def generate_in_order(engine, prompts, params, use_tqdm: bool = False) -> list[Rollout]:
    """Drive any engine (add_request / step) until every request finishes; rollouts in request order,
    a request the engine refuses gets finish_reason 'error'. `params`: one SamplingParams or a list."""
    params_list = params if isinstance(params, (list, tuple)) else [params] * len(prompts)
    if len(params_list) != len(prompts):
        raise ValueError(f"{len(prompts)} prompts but {len(params_list)} SamplingParams")
    results: dict[int, Rollout] = {}
    order: list[int | Rollout] = []
    for prompt, p in zip(prompts, params_list):
        try:
            order.append(engine.add_request(prompt, p))
        except (InvalidRequestError, TypeError, ValueError) as err:
            order.append(Rollout(list(prompt) if isinstance(prompt, (list, tuple)) else [],
                                 finish_reason="error", error=str(err)))
    wanted = {x for x in order if isinstance(x, int)}
    progress = None
    if use_tqdm:
        from tqdm.auto import tqdm
        progress = tqdm(total=len(wanted), desc="rollouts")
    while wanted - results.keys():
        for rid, rollout in engine.step():
            results[rid] = rollout
            if progress is not None and rid in wanted:
                progress.update(1)
    if progress is not None:
        progress.close()
    return [results[x] if isinstance(x, int) else x for x in order]


class Engine:
    """model: a model object, a checkpoint directory or "tiny:<arch>". Options: an EngineConfig and/or
    its fields as keywords (rollout_service.config). runner_factory(model, cache, ops, device) ->
    runner replaces how a forward is executed (tensor parallelism)."""

    def __init__(self, model, config: EngineConfig | None = None, *, runner_factory=None, **options):
        self.config = cfg = EngineConfig.build(config, **options)
        self.device = torch.device(cfg.device)
        self.model = load_model(model, self.device, cfg.copy_model)
        self.spec = model_spec(self.model)
        self.window, self.group = cfg.window, cfg.group
        self.decode_policy = DecodePolicy(cfg.verified_decode)  # "auto" | "dvr" | "canonical"
        self.max_num_seqs, self.max_prefill_tokens = cfg.max_num_seqs, cfg.max_prefill_tokens
        self.max_model_len = cfg.max_model_len or self.spec.max_positions
        self.cache = KVCache(self.spec, -(-cfg.kv_cache_tokens // cfg.block_size), cfg.block_size, self.device)
        self._runner_factory = runner_factory
        # MoE layers size each expert's rows on the host (kernels/moe.py): they run eagerly
        self._cuda_graphs = (cfg.cuda_graphs and runner_factory is None and self.device.type == "cuda"
                             and self.spec.moe is None)
        # verifier graphs: one-token steps of every running request, verify windows G at a time
        self.verifier = self._make_runner(CANONICAL_OPS, {1: cfg.max_num_seqs, cfg.window + 1: cfg.group})
        self.fast_path = self._make_fast_path(cfg.fast_path, dict(cfg.fast_path_options))
        self.canonical_decoder = NativeFastPath(self.verifier, log_softmax=K.log_softmax)
        self._ids = itertools.count()
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self._done: list[tuple[int, Rollout]] = []
        self.num_preemptions = 0  # requests whose KV was freed for an older one (recomputed later)

    def _make_runner(self, ops, graph_shapes: dict[int, int]):
        """A runner for `ops`; on CUDA it replays graphs (graph_shapes: tokens per chunk -> max batch)."""
        if self._runner_factory is not None:
            return self._runner_factory(self.model, self.cache, ops, self.device)
        if self._cuda_graphs:
            return GraphedModelRunner(self.model, self.cache, ops, self.device, max_batch=graph_shapes,
                                      max_model_len=self.max_model_len)
        return ModelRunner(self.model, self.cache, ops, self.device)

    def _make_fast_path(self, fast_path, options) -> FastPath:
        if fast_path == "native":
            return NativeFastPath(self._make_runner(FAST_OPS, {1: self.max_num_seqs}))
        if fast_path == "vllm":
            from .fast_path.vllm import VLLMFastPath
            return VLLMFastPath(self.model, **options)
        if isinstance(fast_path, str):
            raise ValueError(f"unknown fast_path {fast_path!r}: use 'native', 'vllm' or a FastPath object")
        return fast_path

    # ---- public API -------------------------------------------------------------------------
    def add_request(self, prompt_token_ids, params: SamplingParams) -> int:
        """Queue a request; raises InvalidRequestError if it can never be served."""
        prompt = check_prompt(prompt_token_ids, self.spec.vocab_size, self.max_model_len)
        params = check_params(params)
        need = self.cache.blocks_for(len(prompt) + params.max_tokens)
        if need > self.cache.num_blocks:
            raise InvalidRequestError(f"request can never fit: prompt + max_tokens needs {need} KV blocks, "
                                      f"the cache has {self.cache.num_blocks}")
        req = Request(next(self._ids), prompt, params, arrival=0)
        req.arrival = req.request_id
        self.waiting.append(req)
        return req.request_id

    def abort(self, request_id: int) -> bool:
        for queue in (self.waiting, self.running):
            for req in list(queue):
                if req.request_id == request_id:
                    queue.remove(req)
                    req.finish_reason = "abort"
                    self._finish(req)
                    return True
        return False

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running or self._done)

    def step(self) -> list[tuple[int, Rollout]]:
        """One scheduling step; returns the requests that finished during it."""
        self._admit()
        if self.running:
            prefill = [r for r in self.running if r.needs_prefill]
            # decode when no prefill could run (blocks held by older requests): no step is ever idle
            if not (prefill and self._prefill(prefill)):
                self._decode([r for r in self.running if not r.needs_prefill])
            for req in [r for r in self.running if r.finish_reason]:
                self.running.remove(req)
                self._finish(req)
        done, self._done = self._done, []
        return done

    def generate(self, prompts, params, use_tqdm: bool = False) -> list[Rollout]:
        """Rollouts in request order; a request that cannot be served gets finish_reason 'error'."""
        return generate_in_order(self, prompts, params, use_tqdm)

    def update_weights(self, state_dict) -> str:
        """Load new weights (names and shapes must match); returns the content digest."""
        digest = load_weights(self.model, state_dict)
        self.fast_path.update_weights(state_dict)
        return digest

    def capture_graphs(self) -> int:
        """Capture all decode / verify-window CUDA graphs now rather than on first use (CUDA only)."""
        runners = (self.verifier, getattr(self.fast_path, "runner", None))
        return sum(r.capture_all() for r in runners if isinstance(r, GraphedModelRunner))

    def weights_digest(self) -> str:
        return model_digest(self.model)

    def canonical_config(self) -> K.CanonicalConfig:
        """The contract this engine's canonical forward runs under (compared with the trainer's)."""
        return K.canonical_config(self.device)

    # ---- scheduling ------------------------------------------------------------------------
    def _admit(self) -> None:
        while self.waiting and len(self.running) < self.max_num_seqs:
            req = self.waiting[0]
            if self.cache.blocks_for(len(req.tokens) + 1) > self.cache.free_blocks:
                break
            self.running.append(self.waiting.popleft())

    def _finish(self, req: Request) -> None:
        self.cache.release(req.block_ids)
        self.fast_path.release(req.request_id)
        self._done.append((req.request_id, req.to_rollout()))

    def _reserve(self, req: Request, num_tokens: int) -> bool:
        """Blocks for num_tokens slots of req, preempting younger requests if needed (so the oldest
        request always progresses); False if req has to wait."""
        while True:
            try:
                self.cache.ensure(req.block_ids, num_tokens)
                return True
            except OutOfBlocks:
                victims = [r for r in self.running if r.arrival > req.arrival and r.block_ids]
                if not victims:
                    return False
                self._preempt(max(victims, key=lambda r: r.arrival))

    def _preempt(self, req: Request) -> None:
        """Free req's KV; it is recomputed canonically (same bits) when it runs again."""
        self.num_preemptions += 1
        self.cache.release(req.block_ids)
        self.fast_path.release(req.request_id)
        req.num_cached = 0
        self.running.remove(req)
        self.waiting.appendleft(req)

    def _prefill(self, reqs: list[Request]) -> bool:
        budget = self.max_prefill_tokens
        items = []
        for req in sorted(reqs, key=lambda r: r.arrival):
            if budget <= 0 or len(items) == self.group or req not in self.running:
                break
            todo = len(req.tokens) - req.num_cached
            take = min(todo, budget)
            if not self._reserve(req, req.num_cached + take):
                break
            items.append((req, take == todo, take))
            budget -= take
        items = [it for it in items if it[0] in self.running]  # a later reservation may preempt
        if items:
            self._canonical_pass([(req, [], final, take) for req, final, take in items])
        return bool(items)

    def _decode(self, reqs: list[Request]) -> None:
        num_verified = sum(r.params.determinism == "verified" for r in reqs)
        strategy = self.decode_policy.choose(num_verified) if num_verified else None
        start, before = time.perf_counter(), sum(len(r.tokens) for r in reqs)
        plans = []  # (request, tokens to decode, verified by DVR?)
        for req in sorted(reqs, key=lambda r: r.arrival):
            if req not in self.running:
                continue  # preempted while reserving for an earlier request
            room = min(req.remaining, self.max_model_len - len(req.tokens))
            dvr = req.params.determinism == "verified" and strategy == "dvr"
            n = min(self.window, room - dvr)  # DVR leaves room for the verifier's own next token
            if self._reserve(req, len(req.tokens) + max(n, 1)):
                plans.append((req, n, dvr))
        plans = [p for p in plans if p[0] in self.running]
        fast = [(r, n) for r, n, dvr in plans if n > 0 and (dvr or r.params.determinism == "off")]
        proposals = self._propose(self.fast_path, fast)
        proposals.update(self._propose(self.canonical_decoder, [(r, n) for r, n, dvr in plans
                                                                if not dvr and r.params.determinism != "off"]))
        windows = []
        for req, n, dvr in plans:
            prop = proposals.get(req.request_id, Proposal([], []))
            if dvr:
                windows.append((req, prop.token_ids, True, None))
            else:  # off proposals and canonical steps are committed as they are
                req.num_cached = len(req.tokens) - 1 + len(prop.token_ids)
                req.commit(prop.token_ids, prop.logprobs, self.max_model_len)
        for first in range(0, len(windows), self.group):  # grouped verification: G windows per pass
            self._canonical_pass(windows[first:first + self.group])
        if strategy is not None:
            committed = sum(len(r.tokens) for r in reqs) - before
            self.decode_policy.record(num_verified, strategy, committed, time.perf_counter() - start)

    @staticmethod
    def _propose(decoder, items) -> dict[int, Proposal]:
        if not items:
            return {}
        outs = decoder.propose([DraftRequest(r.request_id, list(r.tokens), r.params, n, r.block_ids, len(r.prompt))
                                for r, n in items])
        return {r.request_id: p for (r, _), p in zip(items, outs)}

    def _canonical_pass(self, items) -> None:
        """One canonical forward over G requests: items are (req, proposals, final, prefill_take).

        Feeds req.tokens[num_cached:] (+ proposals); for final items samples every window position,
        commits the proposals the verifier agrees with plus the verifier's own next token.
        """
        chunks = []
        for req, props, final, take in items:
            fed = req.tokens[req.num_cached:req.num_cached + take] if take else req.tokens[req.num_cached:]
            chunks.append(Chunk(fed + props, req.num_cached, req.block_ids, (len(props) + 1) if final else 0))
        logits = self.verifier.forward(chunks)
        rows, params, positions = [], [], []
        for (req, props, final, _), lg in zip(items, logits):
            rows.append(lg)
            params += [req.params] * lg.shape[0]
            positions += K.sampling_positions(len(req.tokens), lg.shape[0])
        all_logits = torch.cat(rows)
        tokens = sample_rows(all_logits, params, positions) if all_logits.shape[0] else None
        logps = token_logprobs_at(all_logits, params, tokens, K.log_softmax) if tokens is not None else None
        tokens = tokens.tolist() if tokens is not None else None  # one device-to-host copy per pass
        logps = logps.tolist() if logps is not None else None
        offset = 0
        for (req, props, final, take), chunk in zip(items, chunks):
            if not final:
                req.num_cached += len(chunk.token_ids)
                continue
            n = len(props)
            canon = tokens[offset:offset + n + 1]
            canon_lp = logps[offset:offset + n + 1]
            offset += n + 1
            j = next((i for i in range(n) if canon[i] != props[i]), n)
            if take is None and req.params.determinism == "verified":  # a decode-time verify window
                req.stats.verify_windows += 1
                req.stats.proposed_tokens += n
                req.stats.accepted_tokens += j
                if j < n:
                    req.stats.rollbacks += 1
                    req.stats.recomputed_tokens += n - j
            req.num_cached = len(req.tokens) + j
            req.commit(canon[:j + 1], canon_lp[:j + 1], self.max_model_len)
