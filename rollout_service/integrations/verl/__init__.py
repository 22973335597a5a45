"""verl's PPO/GRPO trainer with a rollout/train log-prob difference of exactly 0, without a fork of verl.

Switched on by one verl config key: `actor_rollout_ref.model.external_lib=rollout_service.integrations.verl`
(config.LIB). Installing this package registers a `verl.plugins` entry point (plugin.load), so every
`import verl` (driver, Ray workers, vLLM servers) installs the hooks below; they do nothing for a model whose
external_lib does not name this package. verl also imports external_lib itself, which installs the same
hooks where entry points are off (VERL_USE_EXTERNAL_PLUGINS=none).

What the hooks change, in verl's own classes (tested with verl 0.9.x, config.SUPPORTED_VERL):
- the driver: `verl.utils.config.validate_config` also runs config.check_config (clear errors for the settings
  this does not run, such as a rollout engine other than vLLM).
- the vLLM rollout server: `engine_kwargs.vllm` gains the plugin's vLLM keywords (rollout.engine_options:
  the canonical model through `hf_overrides`, the sampling rule, its CUDA graphs).
- the FSDP actor and reference: `FSDPEngineWithLMHead.forward_step` scores tokens with the canonical forward
  (actor.canonical_forward_step): sequences packed as verl packs them, each scored as if alone, and the ids past
  the tokenizer's length forbidden as verl's vLLM rollout forbids them.
"""
from __future__ import annotations

from .config import LIB, SUPPORTED_VERL, check_config, check_verl_version, enabled
from .plugin import install

install()  # imported as verl's external_lib: the same hooks as the entry point's

__all__ = ["LIB", "SUPPORTED_VERL", "check_config", "check_verl_version", "enabled", "install"]
