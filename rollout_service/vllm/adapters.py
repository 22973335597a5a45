"""The LoRA adapters a VLLMEngine serves, by name: checked as the native engine checks them
(engine/adapters.checked_adapter), written as PEFT checkpoints, and served by each of its vLLM engines as a
vLLM LoRARequest (the canonical engine through vllm/plugin/request_adapters.py, the stock one through vLLM's
own LoRA). A replaced adapter gets a new lora_int_id and directory; the old ones are dropped once the new one
is in every engine, so a refused adapter changes nothing."""
from __future__ import annotations

import itertools
import shutil
from pathlib import Path
from typing import Callable

from rollout_service.engine.adapters import AdapterInfo, checked_adapter, unknown_adapter
from rollout_service.lora import LoraAdapter, save_adapter
from rollout_service.params import InvalidRequestError


VLLM_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)  # the max_lora_rank values vLLM accepts


def vllm_lora_rank(r: int) -> int:
    """The smallest max_lora_rank vLLM accepts that holds rank `r` (r itself past vLLM's largest)."""
    return next((v for v in VLLM_LORA_RANKS if v >= r), r)


class VLLMAdapters:
    def __init__(self, root: str | Path, targets: Callable[[], list], shapes, max_rank: int):
        self.root, self.targets, self.shapes, self.max_rank = Path(root), targets, shapes, max_rank
        self.requests: dict = {}  # name -> vLLM LoRARequest
        self.info: dict[str, AdapterInfo] = {}
        self.adapters: dict[str, LoraAdapter] = {}
        self._ids = itertools.count(1)

    def load(self, name: str, adapter, expected_digest: str | None, base_digest) -> AdapterInfo:
        from vllm.lora.request import LoRARequest
        adapter, info = checked_adapter(name, adapter, self.shapes, self.max_rank, expected_digest, base_digest)
        lora_id = next(self._ids)
        request = LoRARequest(name, lora_id, str(save_adapter(adapter, self.root / str(lora_id))))
        added = []
        try:
            for target in self.targets():
                target.add_adapter(request)
                added.append(target)
        except Exception:
            for target in added:
                target.remove_adapter(lora_id)
            shutil.rmtree(request.lora_path, ignore_errors=True)
            raise
        old = self.requests.get(name)
        if old is not None:
            self._drop(old)
        self.requests[name], self.info[name], self.adapters[name] = request, info, adapter
        return info

    def remove(self, name: str) -> None:
        self._known(name)
        self._drop(self.requests.pop(name))
        del self.info[name], self.adapters[name]

    def reload(self) -> None:
        """Every adapter served loaded into the engines again (from its checkpoint), as after a sleep that
        discarded their memory."""
        for request in self.requests.values():
            for target in self.targets():
                target.remove_adapter(request.lora_int_id)
                target.add_adapter(request)

    def request(self, name: str):
        """The LoRARequest of adapter `name`, for a request naming it; InvalidRequestError if none is served."""
        if name not in self.requests:
            raise InvalidRequestError(str(unknown_adapter(name, self.requests)))
        return self.requests[name]

    def adapter(self, name: str) -> LoraAdapter:
        self._known(name)
        return self.adapters[name]

    def _known(self, name: str) -> None:
        if name not in self.requests:
            raise unknown_adapter(name, self.requests)

    def _drop(self, request) -> None:
        for target in self.targets():
            target.remove_adapter(request.lora_int_id)
        shutil.rmtree(request.lora_path, ignore_errors=True)
