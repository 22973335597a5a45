"""The memory plan (recipes.memory_plan): its numbers for Qwen shapes, the refusal of a run that cannot fit
a stated GPU, the recipe's exit on it, and a train step that still runs out of memory (TrainerOutOfMemory:
the rank drops the step and steps again). All on CPU: GPU sizes are stated, out-of-memory errors raised."""
from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import transformers

from packing_shared import free_port
from recipes.batch import Sample, split_for_ranks
from recipes.config import ConfigError, TrainerConfig, load_config
from recipes.config import BatchingConfig, OptimizerConfig
from recipes.memory_plan import GpuMemory, MemoryPlanRefused, TrainerOutOfMemory, plan_memory
from recipes.memory_terms import GiB
from recipes.model_shape import BF16, ROTARY_BYTES_PER_HEAD_DIM, SAVED_HIDDEN_AFTER_LAYERS, ModelShape
from rollout_service.tiny_models import tiny_model
from trainer_patch import patch_model, token_logprobs

REPO = Path(__file__).resolve().parents[1]
H200 = GpuMemory(141 * GiB, "a stated 141 GiB GPU")
# the knobs a refusal or an out-of-memory error names (the engine's only where one shares the GPU)
TRAINER_KNOBS = ("trainer.batching.max_tokens_per_micro_batch", "trainer.batching.activation_checkpointing",
                 "trainer.num_ranks", "rollout.max_tokens")
ENGINE_KNOBS = ("rollout.engine.gpu_memory_utilization", "kv_cache_memory_bytes", "rollout.sleep_while_training")


def qwen25_1p5b():
    return transformers.Qwen2Config(hidden_size=1536, num_hidden_layers=28, num_attention_heads=12,
                                    num_key_value_heads=2, intermediate_size=8960, vocab_size=151936,
                                    tie_word_embeddings=True)


def qwen3_4b():
    return transformers.Qwen3Config(hidden_size=2560, num_hidden_layers=36, num_attention_heads=32,
                                    num_key_value_heads=8, head_dim=128, intermediate_size=9728, vocab_size=151936,
                                    tie_word_embeddings=True)


def run_config(*overrides: str):
    """A one-rank GPU run, split placement, 512-token rollouts, then `overrides`."""
    return load_config(REPO / "recipes" / "configs" / "gpu_split.yaml", ["rollout.max_tokens=512", *overrides])


def budget(tokens: int, checkpointing: bool = False, *more: str):
    return run_config(f"trainer.batching.max_tokens_per_micro_batch={tokens}",
                      f"trainer.batching.activation_checkpointing={str(checkpointing).lower()}", *more)


# -- the numbers ---------------------------------------------------------------------------------------

@pytest.mark.parametrize("shapes", [qwen25_1p5b, qwen3_4b], ids=["qwen2.5-1.5b", "qwen3-4b"])
@pytest.mark.parametrize("ranks", [1, 2])
def test_master_weights_grads_and_adam_are_16_bytes_a_parameter_over_the_ranks(shapes, ranks):
    """The plan's parameter count is the transformers model's (built on the meta device), to 0.1%, and the
    sharded states are 16 bytes a parameter divided over the ranks."""
    config = shapes()
    with torch.device("meta"):
        real = sum(p.numel() for p in transformers.AutoModelForCausalLM.from_config(config).parameters())
    plan = plan_memory(budget(16384, False, f"trainer.num_ranks={ranks}"), config, 128, H200)
    assert plan.model.params == pytest.approx(real, rel=1e-3)
    assert sum(plan.sharded_states.values()) == pytest.approx(16 * real / ranks, rel=1e-3)


@pytest.mark.parametrize("arch", ["qwen2", "qwen3", "qwen3_moe"])
def test_the_activation_coefficients_match_what_autograd_saves(arch):
    """What the canonical forward's autograd really keeps (saved tensors' storages, parameters aside) against
    the plan's count per token: dense layers within 2% below it, MoE layers (counted roughly) below it."""
    model = tiny_model(arch, hidden_size=128, intermediate_size=256, num_heads=4, num_kv_heads=2, num_layers=3,
                       vocab_size=96)
    patch_model(model).train()
    tokens = 96
    ids = torch.randint(0, 96, (1, tokens), generator=torch.Generator().manual_seed(0))
    parameters = {p.untyped_storage().data_ptr() for p in model.parameters()}
    saved: dict[int, int] = {}

    def pack(t):
        storage = t.untyped_storage()
        if storage.data_ptr() not in parameters:
            saved[storage.data_ptr()] = storage.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        logp = token_logprobs(model, ids, temperature=1.0)
    assert logp.requires_grad
    shape = ModelShape.of(model.config)
    planned = tokens * (shape.all_layers_saved_bytes_per_token + SAVED_HIDDEN_AFTER_LAYERS * shape.hidden * BF16
                        + ROTARY_BYTES_PER_HEAD_DIM * shape.head_dim)
    measured = sum(saved.values())
    low = 0.98 if arch != "qwen3_moe" else 0.6
    assert low * planned <= measured <= planned, (measured, planned)


def test_plans_of_qwen_shapes_at_16k_tokens_are_plausible():
    """Qwen2.5-1.5B and Qwen3-4B shapes, one rank, 16,384 tokens a micro-batch: activations of tens of GiB
    without checkpointing, a few with it; the 1.5B fits a 141 GiB GPU either way."""
    small = {ck: plan_memory(budget(16384, ck), qwen25_1p5b(), 128, H200) for ck in (False, True)}
    large = {ck: plan_memory(budget(16384, ck), qwen3_4b(), 128, H200) for ck in (False, True)}
    assert 20 * GiB < small[False].activations < 45 * GiB and 40 * GiB < large[False].activations < 90 * GiB
    assert small[True].activations < 4 * GiB and large[True].activations < 8 * GiB
    assert all(plan.fits for plan in small.values()) and large[True].fits
    assert 60 * GiB < large[True].total < 110 * GiB  # 64 GiB of sharded states, then the rest
    small[False].check()


def test_checkpointing_and_a_smaller_budget_shrink_the_activation_term():
    base = plan_memory(budget(16384), qwen3_4b(), 128, H200)
    checkpointed = plan_memory(budget(16384, True), qwen3_4b(), 128, H200)
    halved = plan_memory(budget(8192), qwen3_4b(), 128, H200)
    assert checkpointed.activations < base.activations / 10 and checkpointed.total < base.total
    assert halved.activations == base.activations // 2 and halved.total < base.total
    # without a budget: micro_batch_size rows (else all of a rank's rows) of the longest sequence
    rows = plan_memory(run_config("trainer.batching.micro_batch_size=4"), qwen3_4b(), 128, H200)
    assert rows.tokens == 4 * (128 + 512)
    whole = plan_memory(run_config(), qwen3_4b(), 128, H200)  # 32 prompts x 8 samples on one rank
    assert whole.tokens == 32 * 8 * (128 + 512) and whole.activations > rows.activations


def test_checkpointing_fewer_layers_keeps_more_activations_in_between():
    """trainer.batching.checkpoint_every = N keeps every layer but 0, N, 2N, ...: its activations lie between
    every layer checkpointed and none, growing with N."""
    def plan(every):
        return plan_memory(budget(16384, True, f"trainer.batching.checkpoint_every={every}"), qwen3_4b(), 128, H200)
    none, every = plan_memory(budget(16384), qwen3_4b(), 128, H200), [plan(n) for n in (1, 2, 4, 8)]
    assert every[0].activations == plan_memory(budget(16384, True), qwen3_4b(), 128, H200).activations
    sizes = [p.activations for p in every]
    assert sizes == sorted(sizes) and len(set(sizes)) == 4 and sizes[-1] < none.activations
    # half the layers checkpointed: about half of the unchecked activations
    assert 0.4 * none.activations < every[1].activations < 0.6 * none.activations
    assert "checkpointed every 4 layer(s)" in every[2].report()
    with pytest.raises(ConfigError, match="checkpoint_every"):
        budget(16384, True, "trainer.batching.checkpoint_every=0")


# -- the refusal ---------------------------------------------------------------------------------------

def test_a_run_that_cannot_fit_is_refused_with_its_numbers_and_the_knobs_that_would_fit():
    tokens = 40960  # activations alone past the GPU: no rank count can fit them
    plan = plan_memory(budget(tokens), qwen3_4b(), 128, H200)
    with pytest.raises(MemoryPlanRefused) as refused:
        plan.check()
    assert isinstance(refused.value, ConfigError)  # the recipe ends on it as on any bad config
    message = str(refused.value)
    for knob in TRAINER_KNOBS:
        assert knob in message
    assert f"{plan.total / GiB:.1f} GiB" in message and "141.0 GiB (a stated 141 GiB GPU)" in message
    for name, value in plan.training_terms().items():
        assert f"{value / GiB:.1f} GiB  {name}" in message
    # the fixes it names do fit: the budget it computes, and checkpointing
    fitting = int(re.search(r"trainer\.batching\.max_tokens_per_micro_batch=(\d+)", message).group(1))
    assert 640 <= fitting < tokens
    assert plan_memory(budget(fitting), qwen3_4b(), 128, H200).fits
    assert not plan_memory(budget(fitting + 128), qwen3_4b(), 128, H200).fits
    assert "trainer.batching.activation_checkpointing=true" in message and "(fits)" in message
    # more ranks shard the states, not a rank's 40,960 tokens of activations: none makes this fit
    assert "trainer.num_ranks (now 1): up to 64 ranks alone do not make it fit" in message
    assert not plan_memory(budget(tokens, False, "trainer.num_ranks=64"), qwen3_4b(), 128, H200).fits
    # the same run on a GPU two and a half times the size passes
    plan.on_gpu(GpuMemory(352 * GiB)).check()


def test_the_ranks_a_refusal_advises_are_the_fewest_that_fit():
    """Qwen3-4B shapes at 8,192 tokens on a stated 80 GiB GPU: one rank's 60 GiB of sharded states do not
    fit; the refusal names the fewest ranks that do."""
    small_gpu = GpuMemory(80 * GiB, "a stated 80 GiB GPU")
    with pytest.raises(MemoryPlanRefused) as refused:
        plan_memory(budget(8192), qwen3_4b(), 128, small_gpu).check()
    ranks = int(re.search(r"trainer\.num_ranks=(\d+) \(now 1", str(refused.value)).group(1))
    assert ranks > 1
    assert plan_memory(budget(8192, False, f"trainer.num_ranks={ranks}"), qwen3_4b(), 128, small_gpu).fits
    assert not plan_memory(budget(8192, False, f"trainer.num_ranks={ranks - 1}"), qwen3_4b(), 128, small_gpu).fits


def test_a_colocated_engine_counts_and_its_knobs_are_named():
    """Colocated on one GPU (Qwen2.5-1.5B shapes, 16,384 tokens): the engine asleep holds little while the
    rank trains and its share at the wake, which fits; awake through the step (sleep off) it does not, and
    the refusal names the engine's knobs. A KV cache too large for the wake is refused at the wake."""
    colocated = ["placement=colocated", "rollout.resources_per_worker.num_gpus=0.5",
                 "trainer.placement.resources_per_rank.num_gpus=0.5", "rollout.engine.backend=vllm",
                 "rollout.engine.gpu_memory_utilization=0.6"]
    asleep = plan_memory(budget(16384, False, *colocated), qwen25_1p5b(), 128, H200)
    awake = plan_memory(budget(16384, False, *colocated, "rollout.sleep_while_training=false"), qwen25_1p5b(),
                        128, H200)
    assert asleep.engine_wakes_after_step and not awake.engine_wakes_after_step
    assert asleep.engine.while_training < 4 * GiB < 0.6 * H200.total_bytes <= awake.engine.while_training
    assert asleep.engine.awake == awake.engine.awake
    assert asleep.wake_terms() and not awake.wake_terms()
    assert asleep.fits and not awake.fits
    with pytest.raises(MemoryPlanRefused) as refused:
        awake.check()
    for knob in (*TRAINER_KNOBS, *ENGINE_KNOBS):
        assert knob in str(refused.value)
    assert "rollout.sleep_while_training=true" in str(refused.value) and "(fits)" in str(refused.value)
    # a KV cache that leaves no room at the wake, however few tokens the rank trains on
    too_large = f"rollout.engine.vllm_options.kv_cache_memory_bytes={110 * GiB}"
    big_kv = plan_memory(budget(4096, True, *colocated, too_large),
                         qwen25_1p5b(), 128, H200)
    assert not big_kv.fits and sum(big_kv.wake_terms().values()) == big_kv.total
    with pytest.raises(MemoryPlanRefused, match="the rollout engine's wake"):
        big_kv.check()


@pytest.mark.slow  # over 20 s on a 2-core machine
def test_the_recipe_exits_2_with_the_refusal_and_no_traceback(tmp_path):
    """`python -m recipes.grpo` on a run that cannot fit: the message and status 2, before any model, pool
    or rank starts. The GPU's size is stated by this test (the recipe measures it on a GPU)."""
    stated = ("import runpy, sys\n"
              "import recipes.memory_plan as plans\n"
              "plans.measure_rank_gpu = lambda *args, **kwargs: plans.GpuMemory(141 << 30, 'a stated GPU')\n"
              "sys.argv = ['recipes.grpo', *sys.argv[1:]]\n"
              "runpy.run_module('recipes.grpo', run_name='__main__')\n")
    argv = ["--config", str(REPO / "recipes" / "configs" / "gpu_split.yaml"), "--run-dir", str(tmp_path / "run"),
            "trainer.batching.max_tokens_per_micro_batch=65536", "rollout.max_tokens=512"]
    done = subprocess.run([sys.executable, "-c", stated, *argv], cwd=REPO, capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 2, done.stderr[-3000:]
    assert "Traceback" not in done.stderr
    assert "the run does not fit a trainer rank's GPU" in done.stderr and "141.0 GiB (a stated GPU)" in done.stderr
    for knob in TRAINER_KNOBS:
        assert knob in done.stderr
    assert "set up in" not in done.stdout  # refused before the model, the pool and the ranks


# -- a step out of memory ------------------------------------------------------------------------------

def _samples() -> list[Sample]:
    gen = torch.Generator().manual_seed(3)
    return [Sample(torch.randint(0, 96, (3,), generator=gen).tolist(),
                   torch.randint(0, 96, (n,), generator=gen).tolist(), [0.0] * n, (-1.0) ** i)
            for i, n in enumerate([5, 17, 9, 2])]


def _rank(plan=None):
    from recipes.trainer import TrainerRank
    cfg = TrainerConfig(num_ranks=1, optimizer=OptimizerConfig(lr=1e-2),
                        batching=BatchingConfig(max_tokens_per_micro_batch=24))
    rank = TrainerRank(0, 1, cfg, temperature=1.0, memory_plan=plan)
    rank.setup("127.0.0.1", free_port(), tiny_model("qwen2", seed=5))
    return rank


def _step(rank) -> dict:
    samples = _samples()
    plans, tokens = split_for_ranks(samples, 1, 1, 0, 0, 24, True)
    return rank.train_step(plans[0], tokens)


def _weights(rank) -> list[torch.Tensor]:
    return [(p.to_local() if hasattr(p, "to_local") else p).detach().clone() for p in rank.model.parameters()]


def _fresh_step() -> tuple[dict, list[torch.Tensor]]:
    rank = _rank()
    try:
        return _step(rank), _weights(rank)
    finally:
        rank.close()


def _raises_once(real, where: str, at_call: int = 1):
    """`real`, except that its call number `at_call` (after doing its work) raises OutOfMemoryError."""
    calls = []

    def run(*args, **kwargs):
        out = real(*args, **kwargs)  # the real work first: FSDP2 is mid-iteration when it fails
        calls.append(1)
        if len(calls) == at_call:
            raise torch.OutOfMemoryError(f"CUDA out of memory. Tried to allocate 2.00 GiB (in the {where})")
        return out
    return run


@pytest.mark.parametrize("where", ["forward", "backward"])
def test_a_step_out_of_memory_raises_trainer_out_of_memory_and_the_rank_steps_again(where, monkeypatch):
    """A TrainerRank (FSDP2, gloo, one rank) whose forward (or a layer's backward) runs out of memory once:
    TrainerOutOfMemory with the plan's numbers and the knobs; the next step on the same rank is the step a
    fresh rank takes, to the bit (the failed one left no gradient, no update, no FSDP2 state behind)."""
    import kernels.backward
    import recipes.trainer
    fresh, fresh_weights = _fresh_step()
    plan = plan_memory(load_config(None, ["trainer.num_ranks=1"]), tiny_model("qwen2").config, 3, H200)
    rank = _rank(plan)
    try:
        if where == "forward":
            monkeypatch.setattr(recipes.trainer, "token_logprobs", _raises_once(token_logprobs, where))
        else:  # the norms' grads run five times a backward (the final norm, two per layer); the fourth is in
            # the first layer, once the second layer's gradients are reduced into its parameters' .grad
            monkeypatch.setattr(kernels.backward, "_rms_norm_grads",
                                _raises_once(kernels.backward._rms_norm_grads, where, at_call=4))
        with pytest.raises(TrainerOutOfMemory) as oom:
            _step(rank)
        assert isinstance(oom.value, RuntimeError) and oom.value.__cause__ is None
        message = str(oom.value)
        assert "ran out of GPU memory" in message and f"in the {where}" in message
        assert "none of its optimizer steps was applied" in message
        assert "141.0 GiB (a stated 141 GiB GPU)" in message and "total" in message
        for knob in (*TRAINER_KNOBS, *ENGINE_KNOBS):
            assert knob in message
        assert all(p.grad is None for p in rank.model.parameters())
        again = _step(rank)
        for key in ("loss_sum", "grad_norm", "tokens", "clipped_tokens", "agreement"):
            assert again[key] == fresh[key], key
        assert again["grad_norm"][0] > 0
        assert all(torch.equal(a, b) for a, b in zip(_weights(rank), fresh_weights))
    finally:
        rank.close()


def test_a_vllm_wake_out_of_memory_names_the_knobs_and_stays_asleep():
    """VLLMInstance.wake: vLLM's allocator failing to map memory back (its RuntimeError, or torch's
    OutOfMemoryError) becomes EngineWakeOutOfMemory with the knobs; the tags stay asleep for the next wake,
    which maps them; any other error passes through as it is."""
    from rollout_service.vllm.instance import SLEEP_TAGS, EngineWakeOutOfMemory, VLLMInstance

    class FakeLLM:
        def __init__(self, errors):
            self.errors, self.woken = list(errors), []

        def wake_up(self, tags=None):
            if self.errors:
                raise self.errors.pop(0)
            self.woken.append(tags)

    instance = VLLMInstance.__new__(VLLMInstance)
    instance._asleep_tags = SLEEP_TAGS
    instance.llm = FakeLLM([RuntimeError("CUDA Error: out of memory at csrc/cumem_allocator.cpp:62"),
                            torch.OutOfMemoryError("CUDA out of memory"), RuntimeError("engine core died")])
    for _ in range(2):
        with pytest.raises(EngineWakeOutOfMemory) as failed:
            instance.wake()
        assert instance.sleeping and "out of memory" in str(failed.value)
        for knob in ("rollout.engine.gpu_memory_utilization", "kv_cache_memory_bytes", "trainer.num_ranks",
                     "rollout.sleep_while_training"):
            assert knob in str(failed.value)
    with pytest.raises(RuntimeError, match="engine core died") as other:
        instance.wake()
    assert not isinstance(other.value, EngineWakeOutOfMemory) and instance.sleeping
    instance.wake()
    assert not instance.sleeping and instance.llm.woken == [None]



@pytest.mark.parametrize("name", ["gpu_colocated.yaml", "gpu_split.yaml", "gpu_colocated_4b.yaml"])
def test_the_shipped_gpu_configs_fit_an_h200(name):
    """Each GPU config's plan, with the model it builds (read from its config, no weights) and its longest
    prompt, fits a 141 GiB GPU; the 4B config only with its activation checkpointing."""
    from recipes.models import policy_config
    from recipes.task import build_task

    cfg = load_config(REPO / "recipes" / "configs" / name)
    task = build_task(cfg)
    longest = max(len(ids) for ids in task.dataset["prompt_ids"])
    plan = plan_memory(cfg, policy_config(cfg, task.tokenizer), longest).on_gpu(H200)
    plan.check()
    assert plan.total < H200.total_bytes
    if name == "gpu_colocated_4b.yaml":
        assert policy_config(cfg, task.tokenizer).tie_word_embeddings
        without = load_config(REPO / "recipes" / "configs" / name, ["trainer.batching.activation_checkpointing=false"])
        with pytest.raises(MemoryPlanRefused):
            plan_memory(without, policy_config(without, task.tokenizer), longest).on_gpu(H200).check()


def test_a_lora_plan_counts_the_adapters_parameters_and_a_frozen_bf16_base():
    """The adapter's parameter count is PEFT's own; the base costs 2 bytes a parameter, the adapter 16."""
    pytest.importorskip("peft")
    from peft import LoraConfig, inject_adapter_in_model

    from recipes.model_shape import ModelShape
    from rollout_service.tiny_models import tiny_model
    model = tiny_model("qwen3", hidden_size=64, num_heads=4, num_kv_heads=2, head_dim=24, intermediate_size=96)
    targets = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    inject_adapter_in_model(LoraConfig(r=8, target_modules=targets, lora_dropout=0.0), model)
    peft_count = sum(p.numel() for n, p in model.named_parameters() if ".lora_" in n)
    assert ModelShape.of(model.config).lora_params(8, targets) == peft_count
    plan = plan_memory(run_config("model.lora.r=16", "model.lora.target_modules=[all-linear]"), qwen3_4b(), 128, H200)
    states = plan.sharded_states
    assert states[next(k for k in states if k.startswith("frozen base"))] == 2 * plan.model.params
    assert sum(v for k, v in states.items() if not k.startswith("frozen base")) == 16 * plan.trained_params


def test_lora_at_8b_fits_one_h200_where_the_full_fine_tune_is_refused():
    from recipes.models import policy_config
    from recipes.task import build_task

    path = REPO / "recipes" / "configs" / "gpu_colocated_8b_lora.yaml"
    cfg = load_config(path)
    task = build_task(cfg)
    longest = max(len(ids) for ids in task.dataset["prompt_ids"])
    model_config = policy_config(cfg, task.tokenizer)
    plan_memory(cfg, model_config, longest).on_gpu(H200).check()
    full = load_config(path, ["model.lora=null"])
    with pytest.raises(MemoryPlanRefused, match="master weights"):
        plan_memory(full, policy_config(full, task.tokenizer), longest).on_gpu(H200).check()
