"""Which verl config turns zero KL on, and which verl settings it runs (the rest raise, listed together).

On: `actor_rollout_ref.model.external_lib` names LIB (a string, or a list holding it). The actor, the reference
and the vLLM server each hold that model config, so each decides from the config it was built with.
"""
from __future__ import annotations

from ..versions import check_version

LIB = "rollout_service.integrations.verl"
# The verl releases whose internals the hooks were checked against: [lower, upper). 0.9 is the first with the
# `verl.plugins` entry-point group and the engine workers' FSDPEngineWithLMHead.forward_step.
SUPPORTED_VERL = ((0, 9), (0, 10))
# engine_kwargs.vllm keys the plugin sets itself (rollout.engine_options); a user value would replace them
PLUGIN_ENGINE_KEYS = ("hf_overrides", "logits_processors", "logprobs_mode", "compilation_config")


class VerlConfigError(ValueError):
    """A verl setting the zero-KL integration does not run; the message lists every one found."""


def check_verl_version() -> str:
    """The installed verl version; raises ImportError outside SUPPORTED_VERL."""
    return check_version("verl", SUPPORTED_VERL, "verl", "pip install 'zerokl[verl]'")


def select(cfg, path: str, default=None):
    """cfg's value at dotted `path` (an OmegaConf DictConfig, a dict or attribute objects); `default` where a
    key is absent, None or OmegaConf's mandatory '???'."""
    node = cfg
    for key in path.split("."):
        if node is None:
            return default
        try:
            node = node.get(key) if hasattr(node, "get") else getattr(node, key, None)
        except Exception as error:  # OmegaConf's MissingMandatoryValue: a '???' left unset
            if type(error).__name__ != "MissingMandatoryValue":
                raise
            return default
    return default if node is None else node


def enabled(model_config) -> bool:
    """Whether a verl model config (actor_rollout_ref.model, or the HFModelConfig built from it) turns zero KL
    on: its external_lib names LIB."""
    libs = select(model_config, "external_lib")
    if libs is None:
        return False
    if isinstance(libs, str):
        libs = [libs]
    return LIB in [str(lib).strip() for lib in libs]


def check_config(config) -> None:
    """Raises VerlConfigError listing every setting of a verl PPO config (`ppo_trainer`, as verl's hydra main
    builds it) that the integration does not run, when it is on; nothing when it is off."""
    if not enabled(select(config, "actor_rollout_ref.model")):
        return
    check_verl_version()
    problems = []

    def need(ok: bool, message: str):
        if not ok:
            problems.append(message)

    arr = "actor_rollout_ref"
    name = select(config, f"{arr}.rollout.name")
    need(name == "vllm", f"{arr}.rollout.name={name!r}: only vllm runs the canonical model (set it to vllm)")
    for role in ("actor", "ref"):
        strategy = select(config, f"{arr}.{role}.strategy")
        if role == "ref" and strategy is None:
            continue
        # FSDP2 keeps the patched instance forwards of the Hugging Face model (trainer_patch); FSDP1 wraps each
        # layer in a module of its own
        need(strategy == "fsdp2", f"{arr}.{role}.strategy={strategy!r}: the canonical forward runs under FSDP2 "
                                  f"(set {arr}.{role}.strategy=fsdp2)")
        sp = select(config, f"{arr}.{role}.ulysses_sequence_parallel_size", 1)
        need(sp == 1, f"{arr}.{role}.ulysses_sequence_parallel_size={sp}: sequence parallelism splits a "
                      f"sequence across ranks, which the canonical forward does not (set it to 1)")
    need(bool(select(config, f"{arr}.rollout.calculate_log_probs", False)),
         f"{arr}.rollout.calculate_log_probs=False: the rollout's log-probs are the ones the trainer's equal "
         f"(set it to True)")
    temperature = select(config, f"{arr}.rollout.temperature", 1.0)
    need(temperature > 0, f"{arr}.rollout.temperature={temperature}: verl's actor divides by it (use > 0)")
    top_k, top_p = select(config, f"{arr}.rollout.top_k", -1), select(config, f"{arr}.rollout.top_p", 1.0)
    need(top_k in (-1, 0) and top_p == 1.0,
         f"{arr}.rollout.top_k={top_k}, top_p={top_p}: verl's actor scores the full distribution, so the rollout "
         f"samples from it (top_k=-1, top_p=1.0)")
    lora = select(config, f"{arr}.model.lora_rank", 0) or select(config, f"{arr}.model.lora.rank", 0)
    need(not lora, f"{arr}.model.lora_rank={lora}: verl's LoRA rollout (vLLM LoRARequests) is not supported")
    engine = select(config, f"{arr}.rollout.engine_kwargs.vllm", None) or {}
    taken = [key for key in PLUGIN_ENGINE_KEYS if select(engine, key) is not None]
    need(not taken, f"{arr}.rollout.engine_kwargs.vllm sets {taken}: the integration sets these itself "
                    f"(the canonical model and its sampling rule); leave them out")
    if problems:
        raise VerlConfigError("zero KL (actor_rollout_ref.model.external_lib=" + LIB + ") cannot run this verl "
                              "config:\n- " + "\n- ".join(problems))
