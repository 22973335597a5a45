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

import copy
import itertools
import json
import time
from pathlib import Path

import torch

import kernels as K
from kernels.forward import CANONICAL_OPS, SUPPORTED_ARCHITECTURES, model_spec
from kernels.moe import capturable
from rollout_service.engine.config import EngineConfig
from rollout_service.engine.cuda_graphs import GraphedModelRunner
from rollout_service.engine.decode_policy import DecodePolicy
from rollout_service.engine.decoder import WindowedDecoder
from rollout_service.engine.fast_path.base import DraftRequest, FastPath, Proposal
from rollout_service.engine.fast_path.native_ops import FAST_OPS
from rollout_service.engine.kv_cache import KVCache
from rollout_service.engine.request import Request
from rollout_service.engine.runner import ModelRunner
from rollout_service.engine.scheduler import DecodeWork, PrefillWork, Scheduler, StepPlan
from rollout_service.engine.verifier import Verifier, VerifyItem
from rollout_service.params import Determinism, InvalidRequestError, Rollout, SamplingParams, check_batch, check_request
from rollout_service.tiny_models import ARCHITECTURES, TINY_PREFIX, tiny_model
from rollout_service.weights import copy_into, load_weights, model_digest, weight_spec


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


def check_model_source(model) -> None:
    """What can be checked of a model without loading it, so that a bad one fails at the call with a
    one-line FileNotFoundError / ValueError (inside a worker it would surface as an actor's death):
    a "tiny:" name, or a checkpoint directory whose config loads, names a supported architecture and
    whose safetensors files are complete."""
    if isinstance(model, str) and model.startswith(TINY_PREFIX):
        if model[len(TINY_PREFIX):] not in ARCHITECTURES:
            raise ValueError(f"unknown tiny model {model!r}: use {TINY_PREFIX}<{'|'.join(ARCHITECTURES)}>")
        return
    if not isinstance(model, (str, Path)):
        return
    path = Path(model)
    if not path.is_dir():
        raise FileNotFoundError(f"model path {str(model)!r} is not a local directory (no model hub is contacted; "
                                f"pass a saved checkpoint, {TINY_PREFIX}<{'|'.join(ARCHITECTURES)}> or a model object)")
    import transformers
    try:
        config = transformers.AutoConfig.from_pretrained(path)
    except Exception as e:
        raise ValueError(f"model path {str(path)!r}: its config does not load ({type(e).__name__}: "
                         f"{str(e).splitlines()[0] if str(e) else ''})") from None
    archs = getattr(config, "architectures", None) or []
    if not set(archs) & set(SUPPORTED_ARCHITECTURES):
        raise ValueError(f"model path {str(path)!r}: architecture {archs} is not supported "
                         f"(supported: {', '.join(SUPPORTED_ARCHITECTURES)})")
    files = sorted(path.glob("*.safetensors"))
    if not files and not list(path.glob("*.bin")):
        raise FileNotFoundError(f"model path {str(path)!r} has no weights (*.safetensors or *.bin)")
    for f in files:
        _check_safetensors(f)


def _check_safetensors(path: Path) -> None:
    """ValueError unless the file is as long as its header says (a truncated copy is not)."""
    size = path.stat().st_size
    with open(path, "rb") as fh:
        head = fh.read(8)
        n = int.from_bytes(head, "little") if len(head) == 8 else -1
        header = fh.read(n) if 0 < n <= size - 8 else b""
    try:
        meta = json.loads(header)
        end = max((v["data_offsets"][1] for k, v in meta.items() if k != "__metadata__"), default=0)
    except (ValueError, KeyError, TypeError):
        raise ValueError(f"{str(path)!r} is not a readable safetensors file") from None
    if size != 8 + n + end:
        raise ValueError(f"{str(path)!r} is truncated or corrupt: {size} bytes, its header describes {8 + n + end}")


def generate_in_order(engine, prompts, params, use_tqdm: bool = False) -> list[Rollout]:
    """Drive any engine (add_request / step) until every request finishes; rollouts in request order,
    a request the engine refuses gets finish_reason 'error'. `params`: one SamplingParams or a list."""
    check_batch(prompts, params)
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
    pending = {x for x in order if isinstance(x, int)}
    progress = None
    if use_tqdm:
        from tqdm.auto import tqdm
        progress = tqdm(total=len(pending), desc="rollouts")
    while pending:  # per step: only the finished requests are looked at
        for rid, rollout in engine.step():
            results[rid] = rollout
            if rid in pending:
                pending.discard(rid)
                if progress is not None:
                    progress.update(1)
    if progress is not None:
        progress.close()
    return [results[x] if isinstance(x, int) else x for x in order]


class Engine:
    """model: a model object, a checkpoint directory or "tiny:<arch>". Options: an EngineConfig and/or
    its fields as keywords (rollout_service.engine.config). runner_factory(model, cache, ops, device) ->
    runner replaces how a forward is executed (tensor parallelism)."""

    # update_weights between two steps with requests running is exact (see the rule above
    # update_weights): a pool may push to it in "switch-in-flight" mode (service/switch_modes.py)
    switches_weights_in_flight = True

    def __init__(self, model, config: EngineConfig | None = None, *, runner_factory=None, **options):
        self.config = cfg = EngineConfig.build(config, **options)
        self.device = torch.device(cfg.device)
        self.model = load_model(model, self.device, cfg.copy_model)
        self.spec = model_spec(self.model)
        self.window, self.group = cfg.window, cfg.group
        self.max_num_seqs = cfg.max_num_seqs
        self.max_model_len = cfg.max_model_len or self.spec.max_positions
        self.cache = KVCache(self.spec, -(-cfg.kv_cache_tokens // cfg.block_size), cfg.block_size, self.device)
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
            return self._runner_factory(self.model, self.cache, ops, self.device)
        # MoE layers whose experts are sized on the host (kernels/moe.py's loop) cannot be captured
        if self._cuda_graphs and (self.spec.moe is None or capturable(ops, self.device)):
            return GraphedModelRunner(self.model, self.cache, ops, self.device, max_batch=graph_shapes,
                                      max_model_len=self.max_model_len)
        return ModelRunner(self.model, self.cache, ops, self.device)

    def _make_fast_path(self, fast_path, options) -> FastPath:
        if fast_path == "native":
            return WindowedDecoder(self._make_runner(FAST_OPS, {1: self.max_num_seqs}))
        if fast_path == "vllm":
            from rollout_service.vllm.proposer import VLLMProposer
            return VLLMProposer(self.model, **options)
        if isinstance(fast_path, str):
            raise ValueError(f"unknown fast_path {fast_path!r}: use 'native', 'vllm' or a FastPath object")
        return fast_path

    # ---- public API -------------------------------------------------------------------------
    def add_request(self, prompt_token_ids, params: SamplingParams) -> int:
        """Queue a request; raises InvalidRequestError if it can never be served."""
        prompt, params = check_request(prompt_token_ids, params, self.spec.vocab_size, self.max_model_len)
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

    # bucketed pushes (rollout_service.service.weight_sync): tensors already checked against the sender's
    def weight_spec(self) -> dict[str, tuple[int, ...]]:
        return weight_spec(self.model)

    def load_named_weights(self, named) -> None:
        copy_into(self.model, named)

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
        fast = [w for w in plan.decode if w.num_tokens > 0 and (w.verify or w.req.params.determinism == Determinism.OFF)]
        canonical = [w for w in plan.decode if not w.verify and w.req.params.determinism != Determinism.OFF]
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
