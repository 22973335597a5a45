"""`vllm serve` with the plugin (rollout_service.vllm.plugin.serve): /v1/completions answers token-id
prompts with the canonical tokens and log-probs, bitwise equal to trainer_patch.token_logprobs and to
the native Engine for the same seeds; bad requests get a 400 and the server keeps serving.

One server (a subprocess on 127.0.0.1) serves the module; runs wherever `import vllm` works (CPU build).
"""
import json
import random
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest
import torch

pytest.importorskip("vllm")

from rollout_service import Engine, SamplingParams  # noqa: E402
from rollout_service.vllm.plugin.seed_echo import SEED_HEADER  # noqa: E402
from rollout_service.vllm.plugin.serve import serve_argv  # noqa: E402
from serve_shared import (call, complete, complete_all, running_server, save_text_tokenizer,  # noqa: E402
                          serve_checkpoint)
from vllm_shared import trainer_logprobs  # noqa: E402

MODEL_KW = dict(hidden_size=128, num_heads=4, num_kv_heads=2, intermediate_size=256)  # head_dim 32
VOCAB = 96
MAX_BATCHED = 48  # longer prompts are prefilled in chunks
CHAT_TEMPLATE = "{% for m in messages %}{{ m['content'] }} {% endfor %}"  # word tokens "t<id>" in, ids out


def _prompts(n, seed=0, lo=1, hi=40):
    rng = random.Random(seed)
    return [[rng.randrange(VOCAB) for _ in range(rng.randint(lo, hi))] for _ in range(n)]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return serve_checkpoint(tmp_path_factory, "zerokl-serve", VOCAB, **MODEL_KW)


@pytest.fixture(scope="module")
def policy(checkpoint):
    from transformers import AutoModelForCausalLM
    return AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.bfloat16)


@pytest.fixture(scope="module")
def server(checkpoint, tmp_path_factory):
    log_path = tmp_path_factory.mktemp("zerokl-serve-log") / "server.log"
    tokenizer = tmp_path_factory.mktemp("zerokl-serve-tokenizer")
    save_text_tokenizer(tokenizer, VOCAB)
    try:
        with running_server(checkpoint, log_path, "--block-size", "16", "--kv-cache-memory-bytes", str(64 << 20),
                            "--max-model-len", "256", "--max-num-seqs", "8",
                            "--max-num-batched-tokens", str(MAX_BATCHED), "--tokenizer", str(tokenizer),
                            "--chat-template", CHAT_TEMPLATE) as base:
            yield base
    except RuntimeError as err:  # the server did not come up: the log says why
        pytest.fail(str(err))


CASES = {"T=0.7,seeds 1000+": (0.7, 1000), "T=0.7,seeds 2000+": (0.7, 2000), "greedy": (0.0, 0)}


@pytest.mark.parametrize("case", list(CASES))
def test_matches_trainer_and_native_engine(server, checkpoint, policy, case):
    temperature, seed0 = CASES[case]
    prompts = _prompts(5, seed=1) + _prompts(1, seed=2, lo=70, hi=90)  # the last one is chunked
    params = [SamplingParams(max_tokens=8, temperature=temperature, seed=seed0 + i if temperature else None)
              for i in range(len(prompts))]
    results = complete_all(server, prompts, params)
    for prompt, p, (tokens, logprobs) in zip(prompts, params, results):
        assert len(tokens) == p.max_tokens
        expected = trainer_logprobs(policy, prompt, tokens, temperature)
        assert logprobs == expected, (prompt, tokens)  # JSON floats: shortest repr of the float32 values
        assert np.array_equal(np.float32(logprobs), np.float32(expected))
    rollouts = Engine(checkpoint, window=4, group=4).generate(prompts, params)
    assert [r.token_ids for r in rollouts] == [tokens for tokens, _ in results]
    assert [r.logprobs for r in rollouts] == [logprobs for _, logprobs in results]


def test_seed_and_position_fields(server):
    prompt = _prompts(1, seed=3, lo=20, hi=20)[0]
    ref = complete(server, prompt, 6, temperature=0.7, seed=42)
    assert complete(server, prompt, 6, temperature=0.7, seed=42, position=len(prompt)) == ref  # the default
    assert complete(server, prompt, 6, temperature=0.7, seed=42, position=len(prompt) + 1) != ref
    assert complete(server, prompt, 6, temperature=0.7, seed=43) != ref
    # the request's own seed field stands in for zerokl_seed
    status, body = call(server + "/v1/completions", dict(
        prompt=prompt, max_tokens=6, logprobs=0, return_token_ids=True, ignore_eos=True, seed=42,
        vllm_xargs={"zerokl_temperature": 0.7}))
    assert status == 200, body
    choice = body["choices"][0]
    assert (choice["token_ids"], choice["logprobs"]["token_logprobs"]) == ref


BAD = {
    "token id out of range": dict(prompt=[1, 2, VOCAB]),
    "standard fields, min_p": dict(vllm_xargs=None, temperature=0.7, seed=1, min_p=0.1),
    "standard fields, presence penalty": dict(vllm_xargs=None, temperature=0.7, seed=1, presence_penalty=0.5),
    "standard fields, top_p 0": dict(vllm_xargs=None, temperature=0.7, seed=1, top_p=0.0),
    "vLLM temperature": dict(temperature=0.7),
    "nested dict": dict(vllm_xargs={"zerokl": {"temperature": 0.7, "seed": 1}}),
    "unknown param": dict(vllm_xargs={"zerokl_temperature": 0.7, "zerokl_seed": 1, "zerokl_topk": 5}),
    "bad value": dict(vllm_xargs={"zerokl_temperature": "hot", "zerokl_seed": 1}),
    "repetition penalty": dict(repetition_penalty=1.2),
    "logit bias": dict(logit_bias={"3": 5.0}),
}


def _openai(base):
    from openai import OpenAI
    return OpenAI(base_url=base + "/v1", api_key="unused", max_retries=0)


def test_standard_openai_requests_sample_canonically(server, checkpoint, policy):
    """The OpenAI client's own fields (temperature, top_p, seed, n = 4), concurrent requests: every
    sample's log-probs are the trainer's, sample i is the zerokl request with seed + i, the samples
    differ, and a repeat is identical."""
    client = _openai(server)
    prompts = _prompts(6, seed=11)

    def ask(i):
        out = client.completions.create(model=checkpoint, prompt=prompts[i], n=4, temperature=0.9, top_p=0.95,
                                        seed=500 + 10 * i, max_tokens=6, logprobs=0,
                                        extra_body={"return_token_ids": True, "ignore_eos": True})
        return [(c.token_ids, c.logprobs.token_logprobs) for c in sorted(out.choices, key=lambda c: c.index)]
    with ThreadPoolExecutor(6) as pool:
        first, again = list(pool.map(ask, range(6))), list(pool.map(ask, range(6)))
    assert first == again
    for i, (prompt, samples) in enumerate(zip(prompts, first)):
        assert len({tuple(tokens) for tokens, _ in samples}) > 1
        for j, (tokens, logprobs) in enumerate(samples):
            assert logprobs == trainer_logprobs(policy, prompt, tokens, 0.9)
            assert (tokens, logprobs) == complete(server, prompt, 6, temperature=0.9, top_p=0.95, seed=500 + 10 * i + j)


def test_request_without_a_seed_gets_one_echoed_and_replays(server, checkpoint, policy):
    """A seedless request (n = 3) gets a fresh seed, returned in the x-zerokl-seed header; two such
    requests differ; sending the echoed seed replays each bit for bit; all are the trainer's."""
    client = _openai(server)
    prompt = _prompts(1, seed=12)[0]

    def ask(**seed):
        raw = client.completions.with_raw_response.create(
            model=checkpoint, prompt=prompt, n=3, temperature=1.0, max_tokens=8, logprobs=0,
            extra_body={"return_token_ids": True, "ignore_eos": True}, **seed)
        out = raw.parse()
        choices = sorted(out.choices, key=lambda c: c.index)
        return int(raw.headers[SEED_HEADER]), [(c.token_ids, c.logprobs.token_logprobs) for c in choices]

    (seed1, first), (seed2, second) = ask(), ask()
    assert seed1 != seed2 and first != second
    for tokens, logprobs in first + second:
        assert logprobs == trainer_logprobs(policy, prompt, tokens, 1.0)
    assert ask(seed=seed1) == (seed1, first)
    assert ask(seed=seed2) == (seed2, second)


def test_chat_completions_sample_canonically(server, checkpoint, policy):
    """/v1/chat/completions with the OpenAI client's own fields (n = 4, temperature, top_p, seed): the
    samples differ, repeat exactly, carry the trainer's log-probs over the templated prompt's ids, and
    sample j is the zerokl request with seed + j."""
    client = _openai(server)
    ids = [i % 90 for i in _prompts(1, seed=13, lo=6, hi=20)[0]]
    messages = [{"role": "user", "content": " ".join(f"t{i}" for i in ids)}]

    def ask():
        out = client.chat.completions.create(model=checkpoint, messages=messages, n=4, temperature=0.8, top_p=0.9,
                                             seed=77, max_tokens=6, logprobs=True,
                                             extra_body={"return_token_ids": True, "ignore_eos": True})
        choices = sorted(out.choices, key=lambda c: c.index)
        return out.prompt_token_ids, [(c.token_ids, [t.logprob for t in c.logprobs.content]) for c in choices]

    prompt, samples = ask()
    assert prompt == ids
    assert ask() == (prompt, samples)
    assert len({tuple(tokens) for tokens, _ in samples}) > 1
    for j, (tokens, logprobs) in enumerate(samples):
        assert logprobs == trainer_logprobs(policy, prompt, tokens, 0.8)
        assert (tokens, logprobs) == complete(server, prompt, 6, temperature=0.8, top_p=0.9, seed=77 + j)


@pytest.mark.slow
def test_stock_server_is_not_the_trainer(checkpoint, policy, tmp_path):
    """Negative control: vLLM's own server (plugin not selected), asked the same standard request with
    temperature-scaled log-probs, returns log-probs that are not the trainer's, and echoes no seed."""
    prompt = _prompts(1, seed=14, lo=20, hi=30)[0]
    body = dict(prompt=prompt, n=4, temperature=0.9, seed=5, max_tokens=16, logprobs=0, return_token_ids=True,
                ignore_eos=True)
    try:
        with running_server(checkpoint, tmp_path / "stock.log", "--max-model-len", "256", "--logprobs-mode",
                            "processed_logprobs", plugin=False) as base:
            status, out = call(base + "/v1/completions", body)
    except RuntimeError as err:
        pytest.fail(str(err))
    assert status == 200, out
    differ = sum(a != b for c in out["choices"] for a, b in zip(
        c["logprobs"]["token_logprobs"], trainer_logprobs(policy, prompt, c["token_ids"], 0.9)))
    assert differ > 0, "vLLM's own server matched the trainer bit for bit: this control cannot fail"


def test_bad_requests_get_400_and_server_keeps_serving(server):
    prompt = [5, 6, 7, 8]
    before = complete(server, prompt, 4, temperature=0.7, seed=9)
    good = dict(prompt=prompt, max_tokens=4, logprobs=0, ignore_eos=True,
                vllm_xargs={"zerokl_temperature": 0.7, "zerokl_seed": 9})
    for name, change in BAD.items():
        status, body = call(server + "/v1/completions", {**good, **change})
        assert status == 400, (name, status, body)
        assert isinstance(body, dict) and body.get("error", {}).get("message"), (name, body)
    assert call(server + "/health", timeout=10)[0] == 200
    assert complete(server, prompt, 4, temperature=0.7, seed=9) == before


def test_serve_argv_flags():
    argv = serve_argv("/ckpt", "--port", "1")
    assert argv[0] == sys.executable and argv[-2:] == ["--port", "1"]
    flags = dict(zip(argv, argv[1:]))
    assert json.loads(flags["--hf-overrides"]) == {"architectures": ["ZeroKLForCausalLM"]}
    assert flags["--logits-processors"].endswith(":StrictGumbelLogitsProcessor")
    assert flags["--logprobs-mode"] == "processed_logits"
    assert json.loads(flags["--override-generation-config"]) == {"temperature": 0}
    assert json.loads(flags["--compilation-config"])["cudagraph_mode"] == "FULL_DECODE_ONLY"
    assert "--enforce-eager" in serve_argv("/ckpt", eager=True)


def test_documented_vllm_serve_command_is_the_plugins():
    """docs/integrations.md's plain `vllm serve` line carries exactly the flags the serve module passes."""
    import re
    import shlex
    from rollout_service.vllm.plugin.serve import plugin_args
    page = (Path(__file__).resolve().parents[1] / "docs" / "integrations.md").read_text()
    [command] = re.findall(r"^(vllm serve CHECKPOINT .*?)\n```", page, flags=re.S | re.M)
    argv = shlex.split(command.replace("\\\n", " "))
    assert argv[:5] == ["vllm", "serve", "CHECKPOINT", "--port", "8000"]
    assert argv[5:] == plugin_args()


def test_serve_sizes_a_cpu_kv_cache_unless_told():
    from rollout_service.vllm.plugin.serve import CPU_KV_CACHE_BYTES
    if torch.cuda.is_available():
        pytest.skip("the default applies to CPU servers")
    argv = serve_argv("/ckpt")
    assert argv[argv.index("--kv-cache-memory-bytes") + 1] == str(CPU_KV_CACHE_BYTES)
    for flag in ("--kv-cache-memory-bytes", "--gpu-memory-utilization"):
        assert serve_argv("/ckpt", flag, "1").count(flag) == 1
    assert "--kv-cache-memory-bytes" not in serve_argv("/ckpt", "--gpu-memory-utilization=0.5")


@pytest.mark.slow  # over 20 s on a 2-core machine
def test_documented_server_command_and_request_run_as_written(checkpoint, policy, tmp_path):
    """`python -m rollout_service.vllm.plugin.serve CHECKPOINT --port ...` with no sizing flags (the
    command in docs/integrations.md) starts on this machine and answers that page's request with the trainer's
    log-probs."""
    import re
    page = (Path(__file__).resolve().parents[1] / "docs" / "integrations.md").read_text()
    assert "`python -m rollout_service.vllm.plugin.serve CHECKPOINT --port 8000`" in page
    [body] = re.findall(r"^```\n(\{\"prompt\".*?)\n```", page, flags=re.S | re.M)
    request = json.loads(body)
    try:
        with running_server(checkpoint, tmp_path / "server.log") as base:
            status, answer = call(base + "/v1/completions", request)
    except RuntimeError as err:
        pytest.fail(str(err))
    assert status == 200, answer
    assert len(answer["choices"]) == request["n"] > 1
    for choice in answer["choices"]:
        assert 0 < len(choice["token_ids"]) <= request["max_tokens"]
        assert choice["logprobs"]["token_logprobs"] == trainer_logprobs(
            policy, request["prompt"], choice["token_ids"], request["temperature"])


def test_seed_echo_body_rule():
    """SeedEcho's rewrite: a JSON object without a seed (or with null) gets one; anything else is
    handed to vLLM as it came (vLLM answers a malformed body or seed with its 400)."""
    from rollout_service.vllm.plugin.seed_echo import with_seed
    body, seed = with_seed(b'{"prompt": [1, 2], "n": 2}')
    assert isinstance(seed, int) and 0 <= seed < 2 ** 62 and json.loads(body) == {"prompt": [1, 2], "n": 2, "seed": seed}
    assert with_seed(b'{"prompt": [1], "seed": null}')[1] is not None
    given = b'{"prompt": [1], "seed": 5}'
    assert with_seed(given) == (given, 5)
    for untouched in (b'{"seed": "5"}', b'{"seed": true}', b"[1, 2]", b"not json", b""):
        assert with_seed(untouched) == (untouched, None)
    ours = b'{"prompt": [1], "vllm_xargs": {"zerokl_temperature": 0.7, "zerokl_seed": 9}}'
    assert with_seed(ours) == (ours, 9)  # the seed the sampling rule will use, not a new one
    assert with_seed(b'{"vllm_xargs": {"zerokl_seed": "9"}}')[1] is None


NOT_FOUND_BODIES = {  # vLLM's 404 for a model it does not serve: 0.32's nested error, 0.25's flat one
    "nested": {"error": {"message": "The model `Qwen/Qwen2.5-1.5B` does not exist. Valid aliases: /ckpt.",
                         "type": "NotFoundError", "param": "model", "code": 404}},
    "flat": {"object": "error", "message": "The model `Qwen/Qwen2.5-1.5B` does not exist.",
             "type": "NotFoundError", "param": None, "code": 404},
}


@pytest.mark.parametrize("shape", list(NOT_FOUND_BODIES))
def test_unknown_model_message_gets_the_served_name(shape):
    from types import SimpleNamespace
    from rollout_service.vllm.plugin.model_hint import model_hint, with_model_hint
    hint = model_hint(SimpleNamespace(model="/ckpt", served_model_name=None))
    assert hint == ("this server serves the checkpoint path '/ckpt' as its model name; pass "
                    "--served-model-name NAME to choose one")
    body = NOT_FOUND_BODIES[shape]
    rewritten = json.loads(with_model_hint(json.dumps(body).encode(), hint))
    message = rewritten["error"]["message"] if shape == "nested" else rewritten["message"]
    old = body["error"]["message"] if shape == "nested" else body["message"]
    assert message == f"{old} Note: {hint}."
    assert {**rewritten, "error": None, "message": None} == {**body, "error": None, "message": None}


def test_model_hint_names_a_chosen_name_and_leaves_other_bodies_alone():
    from types import SimpleNamespace
    from rollout_service.vllm.plugin.model_hint import model_hint, with_model_hint
    assert model_hint(SimpleNamespace(model="/ckpt", served_model_name=["qwen", "q"])) == \
        "this server's model names are 'qwen', 'q' (its --served-model-name)"
    assert "--served-model-name" in model_hint(None) and "GET /v1/models" in model_hint(None)
    for body in (b'{"detail": "Not Found"}', b'{"error": {"message": "prompt too long"}}', b"not json", b"[]", b""):
        assert with_model_hint(body, "hint") == body


def test_seed_echo_rewrites_an_unknown_model_404_and_passes_the_rest():
    """The middleware, over an app answering a 404 in two chunks: the hint lands in the body, the
    content-length follows it, the seed header stays; a 200 streams through untouched."""
    import asyncio
    from types import SimpleNamespace
    from rollout_service.vllm.plugin.seed_echo import SeedEcho

    def app_answering(status, body):
        async def app(scope, receive, send):
            await receive()
            await send({"type": "http.response.start", "status": status,
                        "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]})
            await send({"type": "http.response.body", "body": body[:10], "more_body": True})
            await send({"type": "http.response.body", "body": body[10:]})
        return app

    def request(app):
        state = SimpleNamespace(args=SimpleNamespace(model="/ckpt", served_model_name=None))
        scope = {"type": "http", "method": "POST", "path": "/v1/completions", "headers": [],
                 "app": SimpleNamespace(state=state)}
        sent = []

        async def receive():
            return {"type": "http.request", "body": b'{"model": "x", "prompt": [1]}'}

        async def send(message):
            sent.append(message)
        asyncio.run(SeedEcho(app)(scope, receive, send))
        return sent

    not_found = json.dumps(NOT_FOUND_BODIES["nested"]).encode()
    start, *chunks = request(app_answering(404, not_found))
    body = b"".join(c["body"] for c in chunks)
    headers = dict(start["headers"])
    assert "checkpoint path '/ckpt'" in json.loads(body)["error"]["message"]
    assert headers[b"content-length"] == str(len(body)).encode() and SEED_HEADER.encode() in headers
    ok = b'{"choices": [], "padding": "' + b"x" * 40 + b'"}'
    start, *chunks = request(app_answering(200, ok))
    assert start["status"] == 200 and [c["body"] for c in chunks] == [ok[:10], ok[10:]]


@pytest.mark.slow
def test_unknown_model_404_from_the_server_names_the_checkpoint_path(server, checkpoint):
    status, body = call(server + "/v1/completions", dict(model="Qwen/Qwen2.5-1.5B", prompt=[1, 2, 3], max_tokens=2))
    assert status == 404, body
    message = body["error"]["message"]
    assert "Qwen/Qwen2.5-1.5B" in message and f"the checkpoint path '{checkpoint}'" in message, message
    assert "--served-model-name NAME" in message
