"""vLLM's worker, extended as verl's vLLM server extends it, plus one method for test_verl_parts_gpu.py: the push
of the actor's float32 tensors that verl's update_weights_from_ipc makes, without its transport (vLLM imports
this module by name in its worker process)."""
from __future__ import annotations

from pathlib import Path

from verl.workers.rollout.vllm_rollout.utils import vLLMColocateWorkerExtension


class VerlWorkerExtension(vLLMColocateWorkerExtension):
    def push_float32(self, path: str) -> int:
        """The checkpoint's tensors as float32 into the model's load_weights, then vLLM's
        process_weights_after_loading, as verl's update_weights_from_ipc loads them; the count loaded."""
        from safetensors.torch import load_file
        from vllm.model_executor.model_loader.utils import process_weights_after_loading
        model = self.model_runner.model
        tensors = load_file(str(Path(path) / "model.safetensors"), device=str(self.device))
        loaded = model.load_weights([(name, t.float()) for name, t in tensors.items()])
        process_weights_after_loading(model, self.model_runner.vllm_config.model_config, self.device)
        return len(loaded)
