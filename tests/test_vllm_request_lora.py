"""vLLM's per-request LoRA on the canonical model (rollout_service.vllm.plugin.request_adapters): `vllm.LLM` with
enable_lora and a plain LoRARequest per request, adapters read from PEFT checkpoints on disk. Every token's
log-prob is that of the PEFT model its request's adapter was trained in, bit for bit, with several adapters
and the base in one batch, ranks 1, 8 and 64, more adapters than slots; bad adapters are refused with a clear
error and change nothing; stock vLLM's LoRA serving the same adapter does not match (the control)."""
import pytest

pytest.importorskip("vllm")
pytest.importorskip("peft")

from lora_shared import ALL_LINEAR, ATTENTION, base_model, trained_adapter_model  # noqa: E402
from test_vllm_plugin import _checkpoint, _params, _prompts, close, make_llm  # noqa: E402
from vllm.lora.request import LoRARequest  # noqa: E402
from vllm_shared import assert_matches_trainer, count_trainer_mismatches, vllm_generate  # noqa: E402

from rollout_service.lora import AdapterError, adapter_from_model, save_adapter  # noqa: E402
from rollout_service.tiny_models import tiny_model  # noqa: E402

# name -> (lora_int_id, rank, target modules, training seed)
ADAPTERS = {"r8": (1, 8, ALL_LINEAR, 4), "r1": (2, 1, ATTENTION, 5), "r64": (3, 64, ALL_LINEAR, 6)}


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return _checkpoint(tmp_path_factory, "qwen2", seed=7)


@pytest.fixture(scope="module")
def adapters(checkpoint, tmp_path_factory):
    """name -> (PEFT-trained model, LoRARequest of its PEFT checkpoint on disk)."""
    root = tmp_path_factory.mktemp("request-adapters")
    out = {}
    for name, (lora_id, r, targets, seed) in ADAPTERS.items():
        model = trained_adapter_model(checkpoint, r, targets, seed=seed)
        out[name] = (model, LoRARequest(name, lora_id, str(save_adapter(adapter_from_model(model), root / name))))
    return out


@pytest.fixture(scope="module")
def llm(checkpoint):
    llm = make_llm(checkpoint, enable_lora=True, max_loras=2, max_lora_rank=64)  # 2 slots for 3 adapters
    yield llm
    close(llm)


def _check_each(prompts, params, results, scorers):
    """Each request's tokens scored by its own model (an adapter's PEFT model, or the base)."""
    for i, model in enumerate(scorers):
        assert_matches_trainer(model, [prompts[i]], [params[i]], [results[i]])


def test_adapters_and_the_base_in_one_batch_report_their_trainers_logprobs(llm, checkpoint, adapters):
    prompts = _prompts(6, seed=3, hi=30)
    params = _params(len(prompts), "T=0.7", max_tokens=8, seed0=500)
    names = ["r8", "r1", None, "r8", None, "r1"]
    mixed = vllm_generate(llm, prompts, params, [adapters[n][1] if n else None for n in names])
    base = base_model(checkpoint)
    _check_each(prompts, params, mixed, [adapters[n][0] if n else base for n in names])
    # the adapter matters: the base does not score what r8 generated
    assert count_trainer_mismatches(base, [prompts[0]], [params[0]], [mixed[0]]) > 0
    # r64 in a later step takes a slot from one of the others (2 slots); r8 alone then gives the bits it gave
    # beside r1 and the base
    later = vllm_generate(llm, prompts[:3], params[:3], [adapters["r64"][1]] * 2 + [adapters["r8"][1]])
    _check_each(prompts[:3], params[:3], later[:2], [adapters["r64"][0]] * 2)
    assert later[2][:2] == vllm_generate(llm, [prompts[2]], [params[2]], [adapters["r8"][1]])[0][:2]
    assert_matches_trainer(adapters["r8"][0], [prompts[2]], [params[2]], [later[2]])
    again = vllm_generate(llm, prompts, params, [adapters[n][1] if n else None for n in names])
    assert [r[:2] for r in again] == [r[:2] for r in mixed]


def test_bad_adapters_are_refused_and_change_nothing(llm, adapters, tmp_path):
    prompts = _prompts(3, seed=9, hi=20)
    params = _params(len(prompts), "T=1,top_k=5,top_p=0.9", max_tokens=6, seed0=700)
    before = vllm_generate(llm, prompts, params, adapters["r8"][1])
    other = tmp_path / "other-base"  # narrower: an adapter trained on it does not fit this base
    tiny_model("qwen2", seed=7, hidden_size=64, num_heads=4, num_kv_heads=2, intermediate_size=128).save_pretrained(other)
    wrong = save_adapter(adapter_from_model(trained_adapter_model(other, 8, ALL_LINEAR)), tmp_path / "wrong")
    with pytest.raises(AdapterError, match="a different base model or rank"):
        llm.llm_engine.add_lora(LoRARequest("wrong", 40, str(wrong)))
    with pytest.raises(Exception, match="No adapter found"):
        llm.llm_engine.add_lora(LoRARequest("missing", 41, str(tmp_path / "missing")))
    assert not {40, 41} & set(llm.llm_engine.list_loras())
    assert [r[:2] for r in vllm_generate(llm, prompts, params, adapters["r8"][1])] == [r[:2] for r in before]


def _slots_held_in_base_weights(worker) -> list[bool]:
    """In a vLLM worker: per fixed slot, whether its q_proj A is a row block of the fused q/k/v weight."""
    from kernels.lora import row_block
    manager = worker.model_runner.lora_manager
    attn = manager.hf.model.layers[0].self_attn
    fused = attn.__dict__["_zerokl_fused"][("q_proj", "k_proj", "v_proj")].weight
    return [row_block(w.terms[(0, "q_proj")][0], fused) is not None for w in manager.fixed]


def test_hinted_slots_shrink_inside_the_base_products_with_the_same_bits(checkpoint, adapters):
    """lora_hint with enable_lora: each slot's A matrices are rows of the base weights, so the shrinks come out of
    the base products. r8 (the hinted settings, copied into a slot), r1 (other settings: its own tensors in this
    eager engine) and the base in one batch still report their trainers' log-probs bit for bit."""
    from rollout_service.vllm.plugin import HF_OVERRIDES
    from rollout_service.vllm.plugin.lora import lora_hint
    llm = make_llm(checkpoint, enable_lora=True, max_loras=2, max_lora_rank=64,
                   hf_overrides={**HF_OVERRIDES, **lora_hint(8, 16, ALL_LINEAR)})
    try:
        assert llm.collective_rpc(_slots_held_in_base_weights)[0] == [True, True]
        prompts = _prompts(4, seed=9, hi=30)
        params = _params(len(prompts), "T=0.7", max_tokens=8, seed0=700)
        names = ["r8", "r1", None, "r8"]
        mixed = vllm_generate(llm, prompts, params, [adapters[n][1] if n else None for n in names])
        _check_each(prompts, params, mixed, [adapters[n][0] if n else base_model(checkpoint) for n in names])
        assert count_trainer_mismatches(base_model(checkpoint), [prompts[0]], [params[0]], [mixed[0]]) > 0
    finally:
        close(llm)


def test_stock_vllm_lora_differs_from_the_peft_trainer(checkpoint, adapters):
    """The control: vLLM's own model and LoRA layers (punica kernels, scale folded into B) serving the same
    adapter give other log-probs than the PEFT model."""
    prompts = _prompts(4, seed=3, hi=30)
    params = _params(len(prompts), "T=0.7", max_tokens=8, seed0=500)
    stock = make_llm(checkpoint, plugin=False, enable_lora=True, max_loras=2, max_lora_rank=64)
    try:
        served = vllm_generate(stock, prompts, params, adapters["r8"][1])
    finally:
        close(stock)
    assert count_trainer_mismatches(adapters["r8"][0], prompts, params, served) > 0


@pytest.mark.slow  # a Ray pool with a vLLM worker: about a minute on two cores
def test_a_pool_of_vllm_workers_serves_pushed_adapters_exactly(checkpoint, adapters):
    """A pool worker on vLLM (engine_kwargs backend="vllm", max_loras): adapter-only pushes become LoRARequests,
    requests naming either adapter or none share steps and each is its trainer's bit for bit; a replaced adapter
    is served at once; refused pushes and unknown names change nothing."""
    import service_shared as shared
    from lora_shared import logprob_bits, rollout_scores

    from rollout_service import SamplingParams, start_pool
    from rollout_service.lora import LoraAdapter, push_digest
    from test_vllm_plugin import LLM_OPTIONS
    shared.cluster()
    pool = start_pool(checkpoint, num_workers=1, name="vllm-lora", engine_kwargs=dict(
        backend="vllm", device="cpu", max_model_len=256, max_num_seqs=8, max_loras=2, max_lora_rank=64,
        vllm_options=dict(block_size=16, kv_cache_memory_bytes=LLM_OPTIONS["kv_cache_memory_bytes"])))
    prompts = _prompts(6, seed=13, hi=30)
    names = ["r8", "r1", None, "r1", "r8", None]

    def served(names):
        rollouts = pool.generate(prompts[:len(names)], [SamplingParams(max_tokens=8, temperature=1.0, seed=i,
                                                                       adapter=n) for i, n in enumerate(names)])
        assert all(r.ok for r in rollouts), [r.error for r in rollouts]
        return rollouts

    try:
        base_digest = pool.weights_digest()
        for name in ("r8", "r1"):
            adapter = adapter_from_model(adapters[name][0])
            assert pool.load_adapter(name, adapter, expected_digest=push_digest(adapter.digest(), base_digest)) == \
                push_digest(adapter.digest(), base_digest)
        rollouts = served(names)
        scorers = {n: adapters[n][0] for n in ("r8", "r1")} | {None: base_model(checkpoint)}
        for name, rollout in zip(names, rollouts):
            assert logprob_bits([rollout]) == rollout_scores(scorers[name], [rollout]), name
        good = adapter_from_model(adapters["r8"][0])
        with pytest.raises(AdapterError, match="rank 4"):
            pool.load_adapter("r8", LoraAdapter.from_settings({**good.settings(), "r": 4}, good.tensors))
        with pytest.raises(AdapterError, match="other base"):
            pool.load_adapter("r8", good, expected_digest=push_digest(good.digest(), "other base"))
        assert logprob_bits(served(names)) == logprob_bits(rollouts)
        unknown = pool.generate([prompts[0]], [SamplingParams(max_tokens=4, seed=0, adapter="nope")])[0]
        assert not unknown.ok and "unknown adapter 'nope'" in unknown.error
        # r8's name now serves r64's tensors: its requests follow at once (no stale prefix cache)
        pool.load_adapter("r8", adapter_from_model(adapters["r64"][0]))
        replaced = served(["r8", "r8"])
        for rollout in replaced:
            assert logprob_bits([rollout]) == rollout_scores(adapters["r64"][0], [rollout])
        assert all(w["restarts"] == 0 for w in pool.stats()["workers"])
    finally:
        pool.shutdown()


def _scribble_served_adapters(worker) -> int:
    """In a vLLM worker: every adapter the canonical runner holds set to zero, as memory a sleep discarded
    would be garbage (run through collective_rpc). In inference mode: an adapter filled during a step holds
    inference tensors."""
    import torch
    manager = worker.model_runner.lora_manager
    scribbled = 0
    with torch.inference_mode():
        for weights in manager.slot_weights:
            for a, b, _ in (weights.terms.values() if weights is not None else ()):
                a.zero_(), b.zero_()
                scribbled += 1
    return scribbled


def test_a_vllm_engine_reloads_its_adapters_after_their_memory_went(checkpoint, adapters):
    """VLLMEngine built for adapters sleeps at level 1 by default (a LoRA run pushes the adapter alone: level 2
    would reload the frozen base at every push). Where a sleep discarded the adapters' memory (level 2), the
    engine loads each adapter it serves again from its checkpoint (VLLMAdapters.reload): the same bits as
    before; the control, served from the scribbled memory, differs."""
    from rollout_service import SamplingParams
    from rollout_service.vllm.engine import VLLMEngine
    from test_vllm_plugin import LLM_OPTIONS

    engine = VLLMEngine(checkpoint, device="cpu", max_model_len=256, max_num_seqs=8, max_loras=2, max_lora_rank=64,
                        vllm_options=dict(block_size=16, kv_cache_memory_bytes=LLM_OPTIONS["kv_cache_memory_bytes"]))
    try:
        assert engine.sleep_level == 1
        engine.load_adapter("r8", adapter_from_model(adapters["r8"][0]))
        prompts = _prompts(3, seed=17, hi=30)
        params = [SamplingParams(max_tokens=8, temperature=1.0, seed=i, adapter="r8") for i in range(3)]

        def served():
            return [(r.token_ids, r.logprobs) for r in engine.generate(prompts, params)]

        before = served()
        assert engine.canonical.llm.collective_rpc(_scribble_served_adapters)[0] > 0
        assert served() != before  # the control: the scribbled memory is what was served
        engine.lora.reload()
        assert served() == before
    finally:
        engine.close()


def _lifted_names(worker) -> dict:
    """In a vLLM worker: the stock model's parameter names and storage with its LoRA wrappers, and inside
    compat.lora_wrappers_lifted."""
    from vllm.lora.layers import BaseLayerWithLoRA

    from rollout_service.vllm.plugin.compat import lora_wrappers_lifted
    model = worker.model_runner.model

    def seen():
        return {"wrappers": sum(isinstance(m, BaseLayerWithLoRA) for m in model.modules()),
                "params": {n.replace(".base_layer.", "."): p.data_ptr() for n, p in model.named_parameters()
                           if ".lora_" not in n},
                "base_layer_names": sum(".base_layer." in n for n, _ in model.named_parameters())}
    wrapped = seen()
    with lora_wrappers_lifted(model):
        lifted = seen()
    return {"wrapped": wrapped, "lifted": lifted, "after": seen()}


def test_stock_lora_models_take_base_weights_by_their_checkpoint_names(checkpoint):
    """A stock vLLM model built with enable_lora holds each projection inside a LoRA wrapper (names
    "...qkv_proj.base_layer.weight"), where 0.25's weight loading refuses the checkpoint's names (a stock LoRA
    engine woken from a level-2 sleep could not be refilled). Inside compat.lora_wrappers_lifted the wrapped
    layers stand in the tree: no wrapper, the checkpoint's names, the very same parameters; after it the
    wrappers are back."""
    stock = make_llm(checkpoint, plugin=False, enable_lora=True, max_loras=1, max_lora_rank=8)
    try:
        seen = stock.collective_rpc(_lifted_names)[0]
    finally:
        close(stock)
    assert seen["wrapped"]["wrappers"] > 0 and seen["wrapped"]["base_layer_names"] > 0
    assert seen["lifted"]["wrappers"] == 0 and seen["lifted"]["base_layer_names"] == 0
    assert seen["lifted"]["params"] == seen["wrapped"]["params"]
    assert seen["after"] == seen["wrapped"]
