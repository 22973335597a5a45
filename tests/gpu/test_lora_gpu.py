"""LoRA on a GPU: an adapter trained with PEFT through the canonical forward on CUDA reports, in the native
engine's rollouts, the trainer's log-probs bit for bit (ranks 1, 8 and 64, after optimizer steps, several
adapters in one batch); a pool on the sender's GPU takes adapter-only pushes by CUDA IPC and refuses bad
ones without harm."""
from __future__ import annotations

import struct

import pytest
import torch

pytestmark = pytest.mark.gpu

if not torch.cuda.is_available():  # collected on CPU machines only when -m gpu is asked for
    pytest.skip("needs a CUDA GPU", allow_module_level=True)

pytest.importorskip("peft")

from lora_shared import ALL_LINEAR, ATTENTION  # noqa: E402
from rollout_service import Engine, SamplingParams, start_pool  # noqa: E402
from rollout_service.lora import AdapterError, LoraAdapter, adapter_from_model, push_digest  # noqa: E402
from rollout_service.tiny_models import tiny_model  # noqa: E402

ENGINE = {"device": "cuda", "kv_cache_tokens": 4096}
PROMPTS = [[1, 2, 3], [4, 5, 6, 7], [9], [10, 11]]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    path = tmp_path_factory.mktemp("lora-gpu-base")
    tiny_model("qwen2", seed=0, hidden_size=256, intermediate_size=768, num_heads=8, num_kv_heads=2,
               vocab_size=1024).save_pretrained(path)
    return path


def _trained(checkpoint, r, targets, seed=0, steps=3):
    """A PEFT adapter trained on CUDA through the canonical forward, as the trainer trains it."""
    from peft import LoraConfig, inject_adapter_in_model
    from transformers import AutoModelForCausalLM

    import trainer_patch
    model = trainer_patch.patch_model(AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.bfloat16).cuda())
    torch.manual_seed(seed)
    inject_adapter_in_model(LoraConfig(r=r, lora_alpha=2 * r, target_modules=targets, lora_dropout=0.0), model)
    ids = torch.randint(0, 1024, (4, 24), device="cuda")
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    for _ in range(steps):
        trainer_patch.token_logprobs(model, ids).sum().neg().backward()
        opt.step()
        opt.zero_grad()
    return model


def _scores(model, rollouts):
    import trainer_patch
    out = []
    with torch.no_grad():
        for r in rollouts:
            ids = torch.tensor([r.prompt_token_ids + r.token_ids], device="cuda")
            lp = trainer_patch.token_logprobs(model, ids)[0, len(r.prompt_token_ids) - 1:]
            out.append(tuple(struct.pack("<d", float(x)) for x in lp))
    return out


def _bits(rollouts):
    return [tuple(struct.pack("<d", x) for x in r.logprobs) for r in rollouts]


def _params(adapter, seed):
    return SamplingParams(max_tokens=16, temperature=1.0, seed=seed, adapter=adapter)


@pytest.mark.parametrize("r, targets", [(1, ATTENTION), (8, ALL_LINEAR), (64, ALL_LINEAR)])
def test_native_engine_on_cuda_reports_the_trainers_logprobs(checkpoint, r, targets):
    trained = _trained(checkpoint, r, targets)
    engine = Engine(str(checkpoint), **ENGINE)
    engine.load_adapter("policy", adapter_from_model(trained))
    other = _trained(checkpoint, 4, ATTENTION, seed=1)
    engine.load_adapter("other", adapter_from_model(other))
    names = ["policy", "other", "policy", "other"]
    ids = [engine.add_request(p, _params(n, i)) for i, (p, n) in enumerate(zip(PROMPTS, names))]
    done = {}
    while engine.has_unfinished():
        done.update(dict(engine.step()))
    rollouts = [done[i] for i in ids]
    for name, rollout in zip(names, rollouts):
        assert _bits([rollout]) == _scores(trained if name == "policy" else other, [rollout])


def test_adapter_push_by_ipc_lands_and_bad_ones_change_nothing(checkpoint):
    ray = pytest.importorskip("ray")  # the native engine's tests above run without it
    ray.init(include_dashboard=False, log_to_driver=False)
    try:
        pool = start_pool(str(checkpoint), num_workers=1, name="lora-gpu", engine_kwargs={**ENGINE, "backend": "native"},
                          resources_per_worker={"num_cpus": 1, "num_gpus": 0.5})
        trained = _trained(checkpoint, 16, ALL_LINEAR)
        adapter = adapter_from_model(trained)
        on_gpu = LoraAdapter.from_settings(adapter.settings(), {k: v.cuda().bfloat16() for k, v in adapter.tensors.items()})
        base = pool.weights_digest()
        assert pool.load_adapter("policy", on_gpu, transport="ipc") == push_digest(adapter.digest(), base)
        rollouts = pool.generate(PROMPTS, [_params("policy", i) for i in range(len(PROMPTS))])
        assert _bits(rollouts) == _scores(trained, rollouts)
        for bad, kwargs in ((LoraAdapter.from_settings({**adapter.settings(), "r": 4}, on_gpu.tensors), {}),
                            (on_gpu, {"expected_digest": push_digest(adapter.digest(), "other base")})):
            with pytest.raises(AdapterError):
                pool.load_adapter("policy", bad, transport="ipc", **kwargs)
            again = pool.generate(PROMPTS, [_params("policy", i) for i in range(len(PROMPTS))])
            assert _bits(again) == _bits(rollouts)
        assert [w["restarts"] for w in pool.stats()["workers"]] == [0]
        pool.shutdown()
    finally:
        ray.shutdown()


def test_vllm_plugin_adapter_replayed_from_cuda_graphs(tmp_path_factory):
    """The adapter sized at load time (lora_hint) is captured in vLLM's CUDA graphs; a trained adapter copied
    in place is then replayed from them and reports the PEFT trainer's log-probs bit for bit."""
    pytest.importorskip("vllm")
    from test_vllm_plugin_gpu import VOCAB, _checkpoint, _params, _run
    from vllm_shared import assert_matches_trainer, count_trainer_mismatches, random_prompts, vllm_generate

    from rollout_service.vllm.plugin import HF_OVERRIDES
    from rollout_service.vllm.plugin.lora import lora_hint

    path = _checkpoint(tmp_path_factory, "qwen2", seed=6)
    trained = _trained(path, 16, ALL_LINEAR)
    adapter = adapter_from_model(trained)
    prompts = random_prompts(8, VOCAB, seed=4, lo=5, hi=100)
    params = _params(len(prompts), 16, seed0=600)

    def work(llm):
        before = vllm_generate(llm, prompts, params)
        llm.collective_rpc("zerokl_load_adapter", args=(adapter.settings(), dict(adapter.tensors)))
        assert llm.reset_prefix_cache()
        return before, vllm_generate(llm, prompts, params)

    before, after = _run(path, work, hf_overrides={**HF_OVERRIDES, **lora_hint(16, 32, ALL_LINEAR)})
    from transformers import AutoModelForCausalLM
    base = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16).cuda()
    assert_matches_trainer(base, prompts, params, before)  # the hinted adapter starts at zero
    assert_matches_trainer(trained, prompts, params, after)
    assert count_trainer_mismatches(base, prompts, params, after) > 0  # the adapter is what changed them


def test_vllm_request_adapters_replayed_from_cuda_graphs(tmp_path_factory):
    """enable_lora with a LoRARequest per request, CUDA graphs on: two adapters of the hinted settings and the
    base in one batch, each request's log-probs its own PEFT model's bit for bit."""
    pytest.importorskip("vllm")
    from test_vllm_plugin_gpu import VOCAB, _checkpoint, _params, _run
    from vllm.lora.request import LoRARequest
    from vllm_shared import assert_matches_trainer, random_prompts, vllm_generate

    from rollout_service.lora import save_adapter
    from rollout_service.vllm.plugin import HF_OVERRIDES
    from rollout_service.vllm.plugin.lora import lora_hint

    path = _checkpoint(tmp_path_factory, "qwen2", seed=6)
    root = tmp_path_factory.mktemp("gpu-request-adapters")
    models = {name: _trained(path, 16, ALL_LINEAR, seed=seed) for name, seed in (("a", 1), ("b", 2))}
    requests = {name: LoRARequest(name, i + 1, str(save_adapter(adapter_from_model(m), root / name)))
                for i, (name, m) in enumerate(models.items())}
    prompts = random_prompts(6, VOCAB, seed=5, lo=5, hi=100)
    params = _params(len(prompts), 16, seed0=800)
    names = ["a", "b", None, "b", "a", None]
    served = _run(path, lambda llm: vllm_generate(llm, prompts, params, [requests[n] if n else None for n in names]),
                  enable_lora=True, max_loras=2, max_lora_rank=16,
                  hf_overrides={**HF_OVERRIDES, **lora_hint(16, 32, ALL_LINEAR)})
    from transformers import AutoModelForCausalLM
    base = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16).cuda()
    for i, name in enumerate(names):
        assert_matches_trainer(models[name] if name else base, [prompts[i]], [params[i]], [served[i]])
