"""Our sampling rule on vLLM's V2 model runner, which takes no V1-style logits processors.

The V2 runner asks the model for its ModelState class (`get_model_state_cls`) and lets that state
replace the sampler (`ModelState.custom_sampler`); both exist in vLLM 0.25 and 0.32. Our state
records each request's zerokl params and prompt length as vLLM adds it; our sampler applies
sampling.canonical_rows to the rows that carry params. Where every row is ours and asks for no more
than the sampled token's log-prob (the rollout case), it returns vLLM's SamplerOutput itself
(own_sampler_output). Otherwise it leaves only the chosen id finite (vLLM runs them at temperature 0,
so its own sampler picks that id) and then puts our log-prob in the sampled token's column of vLLM's
log-prob output. Rows without params are vLLM's own.

On this runner vLLM has no admission hook for sampling extensions: malformed zerokl params are not
refused at submission (the V1 processor's `validate_params` answers 400 there), so such a request is
sampled by vLLM and a warning is logged. Our engines build params through
vllm.requests.canonical_vllm_params, which cannot be malformed; `vllm serve` runs the V1 processor.
"""
from __future__ import annotations

import functools
import logging

import numpy as np
import torch

from kernels.sampling import check_row_values, sampling_position
from rollout_service.engine.sampler import RowParams
from rollout_service.vllm.plugin.sampling import canonical_rows, keep_only, request_params
from rollout_service.vllm.sampler_graphs import SamplerGraphs

log = logging.getLogger(__name__)


class RequestTable:
    """Each request slot's zerokl params (slots: vLLM's req_state_idx) as host arrays, so that a step
    gathers its rows' params with array indexing instead of a loop over rows."""

    def __init__(self, size: int = 64):
        self.ours = np.zeros(size, dtype=bool)
        self.temperature = np.zeros(size, dtype=np.float32)
        self.top_p = np.ones(size, dtype=np.float32)
        self.top_k, self.seed, self.position, self.prompt_len = (np.zeros(size, dtype=np.int64) for _ in range(4))

    def set(self, slot: int, cfg: dict, prompt_len: int) -> None:
        """Records a request's params (checked here, as stored: steps build their rows unchecked);
        ValueError, and the slot stays vLLM's, where a value breaks the rule's rules."""
        self.clear(slot)
        with np.errstate(over="ignore"):  # a float32 overflow is inf, which the check refuses
            check_row_values(np.float32([cfg["temperature"]]), np.float32([cfg["top_p"]]),
                             np.int64([cfg["position"], prompt_len]))
        if slot >= len(self.ours):
            self._grow(max(slot + 1, 2 * len(self.ours)))
        self.temperature[slot], self.top_k[slot], self.top_p[slot] = cfg["temperature"], cfg["top_k"], cfg["top_p"]
        self.seed[slot], self.position[slot], self.prompt_len[slot] = cfg["seed"], cfg["position"], prompt_len
        self.ours[slot] = True

    def clear(self, slot: int) -> None:
        if slot < len(self.ours):
            self.ours[slot] = False

    def _grow(self, size: int) -> None:
        for name in ("ours", "temperature", "top_p", "top_k", "seed", "position", "prompt_len"):
            old = getattr(self, name)
            new = np.zeros(size, dtype=old.dtype)
            new[: len(old)] = old
            setattr(self, name, new)

    def rows(self, slots: np.ndarray, preceding: np.ndarray) -> tuple[np.ndarray, RowParams | None]:
        """(batch rows that are ours, their RowParams) for a step whose row r holds slot slots[r] with
        preceding[r] tokens before the one sampled now."""
        known = (slots >= 0) & (slots < len(self.ours))  # vLLM marks masked rows with slot -1
        index = np.flatnonzero(known & self.ours[np.where(known, slots, 0)])
        if not len(index):
            return index, None
        at = slots[index]
        # a prefill chunk that does not end the prompt samples a token vLLM discards
        num_outputs = np.maximum(0, preceding[index] - self.prompt_len[at])
        # positions >= 0: both terms are (checked in set)
        return index, RowParams.checked_already(self.temperature[at], self.top_k[at], self.top_p[at], self.seed[at],
                                                sampling_position(self.position[at] + num_outputs))


class CanonicalSampler:
    """Wraps vLLM's V2 Sampler (attributes the runner reads pass through to it)."""

    def __init__(self, base, requests: RequestTable, graphs=None):
        self.base = base
        self.requests = requests  # the model state's
        self.graphs = graphs  # SamplerGraphs where vLLM replays CUDA graphs, else None (eager)

    def __getattr__(self, name):
        return getattr(self.base, name)

    def __call__(self, logits: torch.Tensor, input_batch):
        n = input_batch.num_reqs
        if logits.shape[0] != n:
            raise NotImplementedError("the zerokl sampler takes one logits row per request (no speculative decoding)")
        # tokens before the one sampled now (host counts: no device sync)
        preceding = input_batch.num_computed_tokens_np[:n] + input_batch.num_scheduled_tokens[:n]
        index, params = self.requests.rows(input_batch.idx_mapping_np[:n], preceding)
        if params is None:
            return self.base(logits, input_batch)
        rows_at = None if len(index) == n else torch.from_numpy(index).to(logits.device, non_blocking=True)
        rows = (logits if rows_at is None else logits[rows_at]).float()
        tokens, logprobs = canonical_rows(rows, params, graphs=self.graphs)
        if rows_at is None:
            own = own_sampler_output(self.base, input_batch, tokens, logprobs)
            if own is not None:
                return own
        keep_only(logits, rows_at, tokens, torch.zeros_like(logprobs))
        out = self.base(logits, input_batch)
        if out.logprobs_tensors is not None:
            _report_ours(out.logprobs_tensors, rows_at, tokens, logprobs)
        return out


def _report_ours(tensors, rows_at: torch.Tensor | None, tokens: torch.Tensor, logprobs: torch.Tensor) -> None:
    """Our log-prob wherever vLLM's output lists our sampled token: column 0 (the sampled token, vLLM's
    layout) and, for requests asking for top-k log-probs, the top-k column holding it too."""
    ids, values = tensors.logprob_token_ids, tensors.logprobs
    chosen = torch.full((ids.shape[0],), -1, dtype=ids.dtype, device=ids.device)
    ours = torch.zeros(ids.shape[0], dtype=values.dtype, device=values.device)
    if rows_at is None:
        chosen.copy_(tokens.to(ids.dtype))
        ours.copy_(logprobs.to(values.dtype))
    else:
        chosen.index_copy_(0, rows_at, tokens.to(ids.dtype))
        ours.index_copy_(0, rows_at, logprobs.to(values.dtype))
    values.copy_(torch.where(ids == chosen[:, None], ours[:, None], values))


def own_sampler_output(base, input_batch, tokens: torch.Tensor, logprobs: torch.Tensor):
    """vLLM's SamplerOutput for a batch whose every row is ours, built without vLLM's sampler (its
    fp32 copy of the logits, its argmax and its log-softmax and rank passes over the vocabulary
    decide nothing here); None where the batch needs more than the sampled token and its log-prob
    (top-k or per-token log-probs, NaN counts, 0.32's trace replay, sampling masks or thinking
    budgets), which vLLM's sampler then produces."""
    from vllm.v1.outputs import LogprobsTensors
    from vllm.v1.worker.gpu.input_batch import get_num_sampled_and_rejected
    from vllm.v1.worker.gpu.sample.output import SamplerOutput
    from vllm.v1.worker.gpu.sample.states import NO_LOGPROBS

    thinking = getattr(base, "thinking_budget_state", None)
    if (base.compute_nans or getattr(base, "trace_replay_state", None) is not None
            or getattr(base, "return_sampling_mask", False) or getattr(thinking, "enabled", False)):
        return None
    idx = input_batch.idx_mapping_np
    num_logprobs = base.sampling_states.max_num_logprobs(idx)
    if num_logprobs > 0 or base.logprob_token_ids_state.max_num_token_ids(idx) > 0:
        return None
    tokens = tokens.to(torch.int64)
    logprobs_tensors = None
    if num_logprobs != NO_LOGPROBS:  # the sampled token's column; it is the only finite logit: rank 1
        logprobs_tensors = LogprobsTensors(tokens.unsqueeze(1), logprobs.to(torch.float32).unsqueeze(1),
                                           torch.ones_like(tokens))
    num_sampled, num_rejected = get_num_sampled_and_rejected(
        input_batch.seq_lens.new_ones(input_batch.num_reqs), input_batch.seq_lens, input_batch.cu_num_logits,
        input_batch.idx_mapping, base.req_states.prefill_len.gpu)
    return SamplerOutput(sampled_token_ids=tokens.view(-1, 1), logprobs_tensors=logprobs_tensors, num_nans=None,
                         num_sampled=num_sampled, num_rejected=num_rejected)


def sampler_graphs(vllm_config, device) -> SamplerGraphs | None:
    """Our sampling replayed from CUDA graphs where vLLM replays its own (enforce_eager: eager)."""
    mode = getattr(vllm_config.compilation_config.cudagraph_mode, "name", "NONE")
    if torch.device(device).type != "cuda" or vllm_config.model_config.enforce_eager or mode == "NONE":
        return None
    return SamplerGraphs(vllm_config.scheduler_config.max_num_seqs, vllm_config.model_config.get_vocab_size(),
                         device)


@functools.lru_cache(maxsize=None)
def model_state_class():
    """ZeroKLModelState: vLLM's default model state plus our per-request params and sampler (built on
    first use: it subclasses a vLLM class)."""
    from vllm.v1.worker.gpu.model_states.default import DefaultModelState

    class ZeroKLModelState(DefaultModelState):
        def __init__(self, vllm_config, *args, **kwargs):
            super().__init__(vllm_config, *args, **kwargs)
            if vllm_config.speculative_config is not None:
                raise NotImplementedError("ZeroKLForCausalLM does not run with speculative decoding")
            self.zerokl_requests = RequestTable(vllm_config.scheduler_config.max_num_seqs)

        def add_request(self, req_index, new_req_data) -> None:
            super().add_request(req_index, new_req_data)
            self.zerokl_requests.clear(req_index)
            params = new_req_data.sampling_params
            if params is None:
                return
            try:
                cfg = request_params(params)
            except ValueError as e:
                log.warning("request %s: malformed zerokl params (%s); vLLM samples it", new_req_data.req_id, e)
                return
            prompt = new_req_data.prompt_token_ids  # as submitted: a resumed request keeps it
            if cfg is None or (prompt is None and cfg["position"] is None):
                if cfg is not None:
                    log.warning("request %s: prompt embeddings need zerokl position; vLLM samples it",
                                new_req_data.req_id)
                return
            prompt_len = len(prompt) if prompt is not None else cfg["position"]
            if cfg["position"] is None:
                cfg["position"] = prompt_len
            try:
                self.zerokl_requests.set(req_index, cfg, prompt_len)
            except ValueError as e:  # e.g. a temperature finite in float64 but not in float32
                log.warning("request %s: zerokl params out of range (%s); vLLM samples it", new_req_data.req_id, e)

        def custom_sampler(self, sampler):
            graphs = sampler_graphs(self.vllm_config, self.device)
            if graphs is not None and hasattr(self.model, "use_sampler_graphs"):
                self.model.use_sampler_graphs(graphs)  # its logits land where the graphs read them
            return CanonicalSampler(sampler, self.zerokl_requests, graphs), None

    ZeroKLModelState.__module__ = __name__
    return ZeroKLModelState
