"""What every rollout engine provides: the calls a RolloutWorker makes on it (RolloutEngine), the
extra calls of an engine that takes bucketed weight pushes (BucketedPushEngine), and what it can do
(EngineCapabilities), so that callers ask the engine instead of guessing from its type or config.

Engines: the native Engine (engine.py), rank 0 of a tensor-parallel group (tp/; a worker drives it
through TPGroup.engine()) and VLLMEngine (rollout_service.vllm).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol, runtime_checkable


@dataclass(frozen=True)
class EngineCapabilities:
    # takes every weight-switch mode of service/switch_modes.py, switch-in-flight included: its
    # update_weights between two steps with requests running is exact (it sets weight_version, with
    # which later tokens are stamped)
    switch_modes: bool
    # returns MoE routing records (SamplingParams.return_routed_experts)
    routing_records: bool
    # a BucketedPushEngine: accepts bucketed in-place weight pushes (weight_spec / load_named_weights)
    bucketed_push: bool
    # sleep() releases its GPU memory for another process (wake() maps it again); otherwise sleep,
    # wake and wake_weights are no-ops
    sleep: bool
    # a LoraEngine: serves LoRA adapters on its base, each request naming its own (SamplingParams.adapter)
    lora_adapters: bool = False
    # reuses the KV of prompt prefixes that earlier requests computed, and reports how many prompt tokens
    # each request took from it (RolloutStats.cached_prompt_tokens)
    prefix_cache: bool = False

    @staticmethod
    def common(each: list[EngineCapabilities]) -> EngineCapabilities:
        """What every one of several engines (a pool's workers) can do: each field true only if it is
        true for all of them."""
        if not each:
            raise ValueError("no engines to ask")
        return EngineCapabilities(*(all(getattr(c, f) for c in each) for f in
                                    ("switch_modes", "routing_records", "bucketed_push", "sleep",
                                     "lora_adapters", "prefix_cache")))


@runtime_checkable
class RolloutEngine(Protocol):
    """Requests in, rollouts out, one step at a time; weights replaced whole; the canonical contract."""

    def capabilities(self) -> EngineCapabilities:
        """What this engine can do (constant for its lifetime)."""
        ...

    def add_request(self, prompt_token_ids, params) -> int:
        """Queue a request; raises InvalidRequestError if it can never be served."""
        ...

    def abort(self, request_id: int) -> bool:
        ...

    def step(self) -> list:
        """One step; the (request id, Rollout) pairs that finished during it."""
        ...

    def has_unfinished(self) -> bool:
        ...

    def generate(self, prompts, params) -> list:
        """Rollouts in request order (scripts and tests; a worker steps the engine itself)."""
        ...

    def update_weights(self, state_dict, expected_digest: str | None = None) -> str:
        """Load whole new weights (refused, nothing loaded, when the digest is not the expected one);
        returns their digest."""
        ...

    def weights_digest(self) -> str:
        ...

    def canonical_config(self):
        """The kernels.CanonicalConfig its canonical forward runs under (compared with the trainer's)."""
        ...

    def sleep(self) -> None:
        ...

    def wake_weights(self) -> None:
        """Map the weights' memory again, the rest left asleep (an engine may do nothing here)."""
        ...

    def wake(self) -> None:
        ...


@runtime_checkable
class BucketedPushEngine(RolloutEngine, Protocol):
    """An engine with capabilities().bucketed_push: a push arrives as named tensors, bucket by bucket,
    already checked against the sender's spec (rollout_service.service.weight_sync)."""

    device: object  # the torch.device the buckets are received on

    def weight_spec(self) -> dict:
        """{name: shape} of every tensor a push carries."""
        ...

    def load_named_weights(self, named) -> None:
        """Copy (name, tensor) pairs into the weights in place."""
        ...

    def wait_host_copies(self) -> None:
        """Until the engine has finished reading the tensors given to load_named_weights."""
        ...

    def finish_weight_load(self) -> None:
        """The push is complete and checked: later tokens run on it."""
        ...


@runtime_checkable
class LoraEngine(RolloutEngine, Protocol):
    """An engine with capabilities().lora_adapters: LoRA adapters on its one base model, by name. Loading
    an adapter under a name already served replaces it (an adapter-only push) and, like update_weights,
    starts a new weight version; a refused adapter changes nothing."""

    def load_adapter(self, name: str, adapter, expected_digest: str | None = None,
                     version: int | None = None):
        """Check and serve `adapter` (a rollout_service.lora.LoraAdapter or a PEFT checkpoint directory);
        expected_digest: rollout_service.lora.push_digest(adapter's, base's). Returns its AdapterInfo."""
        ...

    def remove_adapter(self, name: str) -> None:
        ...

    def adapters(self) -> dict:
        """name -> AdapterInfo of every adapter served."""
        ...

    def adapter(self, name: str):
        """The LoraAdapter served as `name`, as it was loaded."""
        ...
