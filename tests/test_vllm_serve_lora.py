"""`vllm serve --enable-lora --lora-modules NAME=DIR` with the plugin: the OpenAI client's `model` field names
the adapter, and each choice's log-probs are the PEFT model's bit for bit, concurrent requests for the base and
two adapters batched together; an unknown model gets a 404; an adapter loaded at run time through vLLM's
/v1/load_lora_adapter is served exactly, and one that does not fit the base is refused with the reason and changes nothing."""
import os
from concurrent.futures import ThreadPoolExecutor

import pytest

pytest.importorskip("vllm")
pytest.importorskip("peft")
pytest.importorskip("openai")

from lora_shared import ALL_LINEAR, ATTENTION, base_model, trained_adapter_model  # noqa: E402
from serve_shared import call, running_server, serve_checkpoint  # noqa: E402
from test_vllm_serve import MAX_BATCHED, MODEL_KW, VOCAB, _openai, _prompts  # noqa: E402
from vllm_shared import trainer_logprobs  # noqa: E402

from rollout_service.lora import adapter_from_model, save_adapter  # noqa: E402
from rollout_service.tiny_models import tiny_model  # noqa: E402

pytestmark = pytest.mark.slow  # a server of its own: about a minute on two cores

RUNTIME_UPDATES = "VLLM_ALLOW_RUNTIME_LORA_UPDATING"  # vLLM's switch for /v1/load_lora_adapter


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return serve_checkpoint(tmp_path_factory, "zerokl-serve-lora", VOCAB, **MODEL_KW)


@pytest.fixture(scope="module")
def adapters(checkpoint, tmp_path_factory):
    """name -> (PEFT-trained model, its PEFT checkpoint directory)."""
    root = tmp_path_factory.mktemp("serve-adapters")
    out = {}
    for name, r, targets, seed in (("r8", 8, ALL_LINEAR, 4), ("r16", 16, ATTENTION, 5)):
        model = trained_adapter_model(checkpoint, r, targets, seed=seed)
        out[name] = (model, str(save_adapter(adapter_from_model(model), root / name)))
    return out


@pytest.fixture(scope="module")
def server(checkpoint, adapters, tmp_path_factory):
    log_path = tmp_path_factory.mktemp("zerokl-serve-lora-log") / "server.log"
    saved = os.environ.get(RUNTIME_UPDATES)
    os.environ[RUNTIME_UPDATES] = "True"
    try:
        with running_server(checkpoint, log_path, "--block-size", "16", "--kv-cache-memory-bytes", str(64 << 20),
                            "--max-model-len", "256", "--max-num-seqs", "8", "--max-num-batched-tokens",
                            str(MAX_BATCHED), "--enable-lora", "--max-loras", "2", "--max-lora-rank", "16",
                            "--lora-modules", f"r8={adapters['r8'][1]}") as base:
            yield base
    except RuntimeError as err:  # the server did not come up: the log says why
        pytest.fail(str(err))
    finally:
        if saved is None:
            os.environ.pop(RUNTIME_UPDATES, None)
        else:
            os.environ[RUNTIME_UPDATES] = saved


def _ask(client, model, prompt, seed):
    out = client.completions.create(model=model, prompt=prompt, n=2, temperature=0.9, seed=seed, max_tokens=6,
                                    logprobs=0, extra_body={"return_token_ids": True, "ignore_eos": True})
    return [(c.token_ids, c.logprobs.token_logprobs) for c in sorted(out.choices, key=lambda c: c.index)]


def test_the_model_field_names_the_adapter(server, checkpoint, adapters):
    client = _openai(server)
    prompts = _prompts(6, seed=21)
    models = ["r8", checkpoint, "r8", checkpoint, "r8", "r8"]
    with ThreadPoolExecutor(6) as pool:  # concurrent: the base and the adapter share steps
        answers = list(pool.map(lambda i: _ask(client, models[i], prompts[i], 300 + i), range(6)))
    base = base_model(checkpoint)
    for model, prompt, samples in zip(models, prompts, answers):
        policy = adapters["r8"][0] if model == "r8" else base
        for tokens, logprobs in samples:
            assert logprobs == trainer_logprobs(policy, prompt, tokens, 0.9)
    tokens, logprobs = answers[0][0]
    assert logprobs != trainer_logprobs(base, prompts[0], tokens, 0.9)  # the adapter changed them
    from openai import NotFoundError
    with pytest.raises(NotFoundError):
        _ask(client, "no-such-adapter", prompts[0], 1)


def test_adapters_loaded_at_run_time_serve_exactly_and_bad_ones_change_nothing(server, checkpoint, adapters,
                                                                                tmp_path):
    client = _openai(server)
    prompt = _prompts(1, seed=22)[0]
    before = _ask(client, "r8", prompt, 7)
    other = tmp_path / "other-base"  # narrower: an adapter trained on it does not fit this base
    tiny_model("qwen2", seed=7, hidden_size=64, num_heads=4, num_kv_heads=2, intermediate_size=128).save_pretrained(other)
    wrong = save_adapter(adapter_from_model(trained_adapter_model(other, 8, ALL_LINEAR)), tmp_path / "wrong")
    status, body = call(server + "/v1/load_lora_adapter", {"lora_name": "wrong", "lora_path": str(wrong)})
    # vLLM answers every adapter its engine fails to load with a 500 carrying the loader's message
    assert status == 500 and "a different base model or rank" in body["error"]["message"], (status, body)
    assert _ask(client, "r8", prompt, 7) == before
    status, body = call(server + "/v1/load_lora_adapter", {"lora_name": "r16", "lora_path": adapters["r16"][1]})
    assert status == 200, body
    for tokens, logprobs in _ask(client, "r16", prompt, 8):
        assert logprobs == trainer_logprobs(adapters["r16"][0], prompt, tokens, 0.9)
    served = {m.id for m in client.models.list().data}
    assert {"r8", "r16"} <= served and "wrong" not in served
