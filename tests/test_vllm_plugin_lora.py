"""A LoRA adapter in vLLM's engine with the canonical model (rollout_service.vllm.plugin.lora): every token runs
the adapter, and the log-probs are the PEFT-trained model's through the canonical forward, bit for bit; an
adapter sized at load time (lora_hint) starts at the base's numbers and takes adapters in place; a bad
adapter is refused and the one served stays."""
import pytest

pytest.importorskip("vllm")
pytest.importorskip("peft")

from lora_shared import ALL_LINEAR, ATTENTION, base_model, trained_adapter_model  # noqa: E402
from test_vllm_plugin import MODEL_KW, _checkpoint, _params, _prompts, close, make_llm  # noqa: E402
from vllm_shared import assert_matches_trainer, vllm_generate  # noqa: E402

from rollout_service.lora import AdapterError, LoraAdapter, adapter_from_model  # noqa: E402
from rollout_service.vllm.plugin import HF_OVERRIDES  # noqa: E402
from rollout_service.vllm.plugin.lora import lora_hint  # noqa: E402

assert MODEL_KW  # the checkpoint's shapes: test_vllm_plugin's


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return _checkpoint(tmp_path_factory, "qwen2", seed=7)


@pytest.fixture(scope="module")
def llm(checkpoint):
    llm = make_llm(checkpoint, hf_overrides={**HF_OVERRIDES, **lora_hint(8, 16, ALL_LINEAR)})
    yield llm
    close(llm)


def _load(llm, adapter: LoraAdapter):
    """The adapter in, then drop KV computed with the old one (as after any weight load)."""
    llm.collective_rpc("zerokl_load_adapter", args=(adapter.settings(), dict(adapter.tensors)))
    assert llm.reset_prefix_cache()


def test_an_adapter_in_vllm_reports_the_trainers_logprobs(llm, checkpoint):
    prompts = _prompts(5, seed=3, hi=30)
    params = _params(len(prompts), "T=0.7", max_tokens=8, seed0=500)
    # the hinted adapter starts at zero: the base model's numbers
    assert_matches_trainer(base_model(checkpoint), prompts, params, vllm_generate(llm, prompts, params))
    trained = trained_adapter_model(checkpoint, 8, ALL_LINEAR, seed=4)
    _load(llm, adapter_from_model(trained))  # same settings as the hint: copied in place
    served = vllm_generate(llm, prompts, params)
    assert_matches_trainer(trained, prompts, params, served)
    # the adapter matters: the base model does not score what the engine served with it
    with pytest.raises(AssertionError):
        assert_matches_trainer(base_model(checkpoint), prompts, params, served)
    with pytest.raises(AdapterError, match="rank 4"):
        bad = adapter_from_model(trained)
        _load(llm, LoraAdapter.from_settings({**bad.settings(), "r": 4}, bad.tensors))
    assert [r[:2] for r in vllm_generate(llm, prompts, params)] == [r[:2] for r in served]  # refused: no change
    other = trained_adapter_model(checkpoint, 16, ATTENTION, seed=5)  # other settings: replaced (eager engine)
    _load(llm, adapter_from_model(other))
    assert_matches_trainer(other, prompts, params, vllm_generate(llm, prompts, params))
