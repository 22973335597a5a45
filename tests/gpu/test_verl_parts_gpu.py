"""verl's two sides, piece by piece, on one GPU: each piece verl adds around the canonical forward keeps the bits.

The quick start (test_verl_quickstart_gpu.py) says whether verl's run as a whole logs a difference of 0.0; these
say which piece breaks it where it does not. The data is the quick start's: the byte-level tiny Qwen2 (its
embedding padded past the tokenizer), GSM8K questions in verl's chat prompt, 4 samples a prompt, 64 tokens.

Rollout side: vLLM with the engine arguments verl's vLLM server passes (bf16, prefix caching, chunked prefill at
8,192 tokens, verl's CUDA-graph mode, processed log-probs) plus the integration's (rollout.engine_options), verl's
own vocabulary mask (monkey_patch_compute_logits, at len(tokenizer)), and plain SamplingParams as verl's agent loop
sends them. Its weights come from the checkpoint, or, as verl runs it, from dummy weights, sleep level 2 and a
push of the actor's float32 tensors through the model's load_weights and vLLM's process_weights_after_loading.
Trainer side: the canonical packed scoring (actor.packed_token_logprobs) of verl's micro-batches, on the plain bf16
model, and on verl's FSDP2 layouts: the actor's (float32 parameters, bf16 mixed precision) and the reference's
(the same with CPU offload).
"""
from __future__ import annotations

import gc
import os
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.gpu

if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)
pytest.importorskip("vllm")
pytest.importorskip("verl")

from conftest import bits  # noqa: E402
from bench.verl_grpo import INSTRUCTION, SHAPES, byte_level_checkpoint  # noqa: E402
from rollout_service.integrations.verl.actor import packed_token_logprobs  # noqa: E402
from rollout_service.integrations.verl.rollout import engine_options  # noqa: E402
from rollout_service.vllm.plugin import compat  # noqa: E402
from verl_shared import gsm8k_folder  # noqa: E402

PROMPTS, SAMPLES, MAX_TOKENS, MICRO_BATCH = 8, 4, 64, 4
WORKER_EXTENSION = "verl_parts_worker.VerlWorkerExtension"  # verl's, plus the float32 push


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    """(checkpoint path, tokenizer, prompt token ids as verl's agent loop sends them)."""
    import json

    from transformers import AutoTokenizer
    path = byte_level_checkpoint(tmp_path_factory.mktemp("verl_parts") / "model", SHAPES["tiny"].model)
    tokenizer = AutoTokenizer.from_pretrained(path)
    prompts = []
    with open(gsm8k_folder() / "train.jsonl") as f:
        for _, line in zip(range(PROMPTS), f):
            messages = [{"role": "user", "content": json.loads(line)["question"] + " " + INSTRUCTION}]
            encoded = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=True)
            prompts.append(list(encoded["input_ids"]))
    return path, tokenizer, prompts


# vLLM as verl's server sets it up, weights from the checkpoint; the same with verl's dummy start, sleep and float32
# push; and with steps of at most 4,096 tokens, which vLLM replays from CUDA graphs (verl's 8,192-token steps with
# prefill chunks run eagerly)
SETUPS = {"checkpoint": dict(weights="checkpoint", step_tokens=8192),
          "pushed": dict(weights="pushed", step_tokens=8192),
          "graphed_steps": dict(weights="checkpoint", step_tokens=4096)}


def rollouts(path: str, tokenizer, prompts: list[list[int]], weights: str,
             step_tokens: int) -> list[tuple[list[int], list[int], list[float]]]:
    """(prompt, response ids, rollout log-probs) per sample."""
    from vllm import LLM, SamplingParams
    # verl's own arguments, then rollout.engine_kwargs.vllm (the integration's), which win
    args = dict(dtype="bfloat16", load_format="dummy" if weights == "pushed" else "auto", enable_prefix_caching=True,
                enable_chunked_prefill=True, max_num_batched_tokens=step_tokens, max_model_len=1024,
                gpu_memory_utilization=0.3, logprobs_mode="processed_logprobs", enable_sleep_mode=weights == "pushed",
                seed=0, worker_extension_cls=WORKER_EXTENSION)
    options = engine_options(path)
    compilation = dict(options.pop("compilation_config"))
    compilation.setdefault("cudagraph_mode", "FULL_AND_PIECEWISE")  # verl's default where none is given
    with compat.engine_core_placement(own_process=True):  # spawned, as verl's server starts it (not forked)
        llm = LLM(model=path, **{**args, **options, "compilation_config": compilation})
    try:
        # verl's server, right after start-up: its mask of the ids past the tokenizer
        llm.collective_rpc("monkey_patch_model", kwargs={"vocab_size": len(tokenizer), "banned_token_ids": None})
        if weights == "pushed":  # verl: sleep after start-up, wake the weights, push, wake the cache
            llm.sleep(level=2)
            llm.wake_up(tags=["weights"])
            assert llm.collective_rpc("push_float32", args=(path,))[0] > 0
            llm.wake_up(tags=["kv_cache"])
        params = SamplingParams(temperature=1.0, top_p=1.0, top_k=-1, max_tokens=MAX_TOKENS, logprobs=0)
        requests = [p for p in prompts for _ in range(SAMPLES)]
        outs = llm.generate([{"prompt_token_ids": p} for p in requests], params, use_tqdm=False)
        result = []
        for prompt, out in zip(requests, outs):
            ids = list(out.outputs[0].token_ids)
            result.append((prompt, ids, [lp[t].logprob for t, lp in zip(ids, out.outputs[0].logprobs)]))
        return result
    finally:
        del llm
        gc.collect()
        torch.cuda.empty_cache()


def trainer_logprobs(model, tokenizer, samples, micro_batch: int = MICRO_BATCH) -> list[torch.Tensor]:
    """Each sample's response log-probs from verl's layout: micro-batches of `micro_batch` sequences packed in one
    row (nested jagged ids, positions from 0), scored with verl's vocabulary limit."""
    device = torch.device("cuda")
    out = []
    for start in range(0, len(samples), micro_batch):
        chunk = samples[start:start + micro_batch]
        seqs = [torch.tensor(p + r, device=device) for p, r, _ in chunk]
        ids = torch.nested.as_nested_tensor(seqs, layout=torch.jagged)
        pos = torch.nested.as_nested_tensor([torch.arange(len(s), device=device) for s in seqs], layout=torch.jagged)
        with torch.no_grad():
            # verl's old-log-prob pass asks for entropies too
            logp, _ = packed_token_logprobs(model, ids, pos, 1.0, vocab_limit=len(tokenizer), entropy=True)
        for (p, r, _), row in zip(chunk, logp.unbind()):
            out.append(row[len(p) - 1: len(p) - 1 + len(r)].float().cpu())
    return out


def mismatch_report(samples, trainer: list[torch.Tensor]) -> tuple[int, int, float]:
    """(tokens whose log-prob bits differ, tokens, max |p_rollout - p_trainer|) over all samples."""
    differ = total = 0
    worst = 0.0
    for (_, _, rollout), ours in zip(samples, trainer):
        got = torch.tensor(rollout, dtype=torch.float32)
        differ += int((bits(got) != bits(ours)).sum())
        total += len(rollout)
        worst = max(worst, float((got.exp() - ours.exp()).abs().max()) if len(rollout) else 0.0)
    return differ, total, worst


def plain_model(path):
    import trainer_patch
    from transformers import AutoModelForCausalLM
    return trainer_patch.patch_model(AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16).cuda())


@pytest.fixture(scope="module")
def samples(setup):
    path, tokenizer, prompts = setup
    with pytest.MonkeyPatch.context() as env:  # vLLM's processes import the worker extension from this folder
        env.setenv("PYTHONPATH", os.pathsep.join([str(Path(__file__).parent), os.environ.get("PYTHONPATH", "")]))
        return {name: rollouts(path, tokenizer, prompts, **settings) for name, settings in SETUPS.items()}


@pytest.mark.parametrize("name", list(SETUPS))
def test_verls_rollout_settings_give_the_trainers_bits(setup, samples, name):
    path, tokenizer, _ = setup
    got = samples[name]
    assert all(max(r) < len(tokenizer) for _, r, _ in got if r), "verl's mask forbids ids past the tokenizer"
    differ, total, worst = mismatch_report(got, trainer_logprobs(plain_model(path), tokenizer, got))
    assert differ == 0, f"{differ} of {total} tokens differ; max |dp| {worst:.3e}"


def test_packed_scoring_equals_each_sequence_alone(setup, samples):
    """The trainer's packed micro-batches against each sequence scored alone, at verl's lengths."""
    path, tokenizer, _ = setup
    got = samples["checkpoint"]
    model = plain_model(path)
    packed, alone = trainer_logprobs(model, tokenizer, got), trainer_logprobs(model, tokenizer, got, micro_batch=1)
    differ = sum(int((bits(a) != bits(b)).sum()) for a, b in zip(packed, alone))
    assert differ == 0, f"{differ} tokens differ between packed and alone"


@pytest.fixture
def nccl_one_rank():
    import torch.distributed as dist
    from packing_shared import free_port
    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


@pytest.mark.parametrize("offload", [False, True], ids=["actor", "reference"])
def test_verls_fsdp2_layouts_give_the_plain_models_bits(setup, samples, nccl_one_rank, offload):
    """verl's FSDPEngine: the actor's model in float32, the reference's in bf16 with CPU offload, each through
    verl's apply_fsdp2 with bf16 mixed precision, then the integration's scoring."""
    import trainer_patch
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy
    from transformers import AutoModelForCausalLM
    from verl.utils.fsdp_utils import apply_fsdp2
    path, tokenizer, _ = setup
    got = samples["checkpoint"]
    want = trainer_logprobs(plain_model(path), tokenizer, got)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16 if offload else torch.float32)
    kwargs = {"mesh": init_device_mesh("cuda", (1,)),
              "mp_policy": MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32,
                                                cast_forward_inputs=True)}
    if offload:
        kwargs["offload_policy"] = CPUOffloadPolicy(pin_memory=True)
    else:
        model = model.cuda()
    apply_fsdp2(model, kwargs, {})
    sharded = trainer_logprobs(trainer_patch.patch_model(model), tokenizer, got)
    differ = sum(int((bits(a) != bits(b)).sum()) for a, b in zip(sharded, want))
    assert differ == 0, f"{differ} of {sum(len(w) for w in want)} tokens differ from the plain bf16 model"
