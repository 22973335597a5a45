"""Our sampling rule on vLLM's V2 model runner, which takes no V1-style logits processors.

The V2 runner asks the model for its ModelState class (`get_model_state_cls`) and lets that state
replace the sampler (`ModelState.custom_sampler`); both exist in vLLM 0.25 and 0.32. Our state
records each request's zerokl params and prompt length as vLLM adds it; our sampler applies
sampling.canonical_rows to the rows that carry params, leaves only the chosen id finite (vLLM runs
them at temperature 0, so its own sampler picks that id) and then puts our log-prob in the sampled
token's column of vLLM's log-prob output. Rows without params are vLLM's own.

On this runner vLLM has no admission hook for sampling extensions: malformed zerokl params are not
refused at submission (the V1 processor's `validate_params` answers 400 there), so such a request is
sampled by vLLM and a warning is logged. Our engines build params through
fast_path.vllm.canonical_vllm_params, which cannot be malformed; `vllm serve` runs the V1 processor.
"""
from __future__ import annotations

import functools
import logging

import torch

from .sampling import canonical_rows, keep_only, request_params

log = logging.getLogger(__name__)


class CanonicalSampler:
    """Wraps vLLM's V2 Sampler (attributes the runner reads pass through to it)."""

    def __init__(self, base, requests: dict[int, tuple[dict, int]]):
        self.base = base
        self.requests = requests  # req_state_idx -> (zerokl params, prompt length); the model state's

    def __getattr__(self, name):
        return getattr(self.base, name)

    def __call__(self, logits: torch.Tensor, input_batch):
        n = input_batch.num_reqs
        if logits.shape[0] != n:
            raise NotImplementedError("the zerokl sampler takes one logits row per request (no speculative decoding)")
        state_idx = input_batch.idx_mapping_np[:n]
        # tokens before the one sampled now (host counts: no device sync)
        preceding = input_batch.num_computed_tokens_np[:n] + input_batch.num_scheduled_tokens[:n]
        index, cfgs, num_outputs = [], [], []
        for row in range(n):
            entry = self.requests.get(int(state_idx[row]))
            if entry is not None:
                cfg, prompt_len = entry
                index.append(row)
                cfgs.append(cfg)
                # a prefill chunk that does not end the prompt samples a token vLLM discards
                num_outputs.append(max(0, int(preceding[row]) - prompt_len))
        if not index:
            return self.base(logits, input_batch)
        rows_at = None if len(index) == n else torch.tensor(index, device=logits.device)
        rows = (logits if rows_at is None else logits[rows_at]).float()
        tokens, logprobs = canonical_rows(rows, cfgs, num_outputs)
        keep_only(logits, rows_at, tokens, torch.zeros_like(logprobs))
        out = self.base(logits, input_batch)
        if out.logprobs_tensors is not None:  # column 0: the sampled token (vLLM's layout)
            column = out.logprobs_tensors.logprobs[:, 0]
            if rows_at is None:
                column.copy_(logprobs.to(column.dtype))
            else:
                column.index_copy_(0, rows_at, logprobs.to(column.dtype))
        return out


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
            self.zerokl_requests: dict[int, tuple[dict, int]] = {}

        def add_request(self, req_index, new_req_data) -> None:
            super().add_request(req_index, new_req_data)
            self.zerokl_requests.pop(req_index, None)
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
            self.zerokl_requests[req_index] = (cfg, prompt_len)

        def custom_sampler(self, sampler):
            return CanonicalSampler(sampler, self.zerokl_requests), None

    ZeroKLModelState.__module__ = __name__
    return ZeroKLModelState
