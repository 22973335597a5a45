"""Multi-turn episodes through the plugin's `vllm serve` with the OpenAI client (recipes/openai_episodes.py):
the first turn is a chat request, every later turn sends the exact ids so far through the field the server's
vLLM reads (0.32: the chat endpoint's kv_transfer_params.prompt_token_ids). Each turn ran on the previous
prompt + the model's ids + the tool's ids; every model token's log-prob is the trainer's from one forward
over the whole trajectory; the control, sending the earlier turns back as text, ran on other ids (the
tokenizer merges letters that the model sampled as separate tokens). The client's errors are checked against
a fake server.

The server (a subprocess on 127.0.0.1, its code from this checkout: serve_shared starts it in the repo root)
serves the module; it runs wherever `import vllm` works (CPU build).
"""
import json

import httpx
import pytest
import torch

from recipes.openai_episodes import ServedChat, ServedIdsError, run_chat_episode
from rollout_service.vllm.openai_ids import chat_ids_fields, parse_version, prompt_ids_route
from serve_shared import ROLE_TEMPLATE, save_merging_tokenizer

MODEL_KW = dict(hidden_size=128, num_heads=4, num_kv_heads=2, intermediate_size=256)
VOCAB = 96
MAX_TURNS = 4
CASES = [dict(user="abcfedaabce", seed=11, temperature=0.8, top_p=0.9, max_tokens=6),
         dict(user="fedcbafe", seed=12, temperature=1.0, top_p=None, max_tokens=5)]


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("zerokl-multiturn-tokenizer")
    save_merging_tokenizer(path, VOCAB)
    return path


@pytest.fixture(scope="module")
def tokenizer(tokenizer_dir):
    from transformers import AutoTokenizer
    return AutoTokenizer.from_pretrained(tokenizer_dir)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    from serve_shared import serve_checkpoint
    return serve_checkpoint(tmp_path_factory, "zerokl-multiturn", VOCAB, **MODEL_KW)


@pytest.fixture(scope="module")
def policy(checkpoint):
    from transformers import AutoModelForCausalLM
    return AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.bfloat16)


@pytest.fixture(scope="module")
def server(checkpoint, tokenizer_dir, tmp_path_factory):
    pytest.importorskip("vllm")
    from serve_shared import running_server
    log_path = tmp_path_factory.mktemp("zerokl-multiturn-log") / "server.log"
    try:
        with running_server(checkpoint, log_path, "--block-size", "16", "--kv-cache-memory-bytes", str(64 << 20),
                            "--max-model-len", "256", "--max-num-seqs", "8", "--tokenizer", str(tokenizer_dir),
                            "--chat-template", ROLE_TEMPLATE) as base:
            yield base
    except RuntimeError as err:  # the server did not come up: the log says why
        pytest.fail(str(err))


@pytest.fixture(scope="module")
def episodes(server, checkpoint, tokenizer):
    """Each case's episode, run twice: [(case, (episode, tool, chat), (episode, tool, chat) again)]."""
    from serve_episodes_shared import run_tool_episode
    return [(case, run_tool_episode(server, checkpoint, tokenizer, case, MAX_TURNS),
             run_tool_episode(server, checkpoint, tokenizer, case, MAX_TURNS)) for case in CASES]


@pytest.mark.slow
def test_turns_continue_from_exact_ids_with_the_trainers_logprobs(episodes, tokenizer, policy):
    import vllm
    from serve_episodes_shared import assert_exact_ids, assert_trainer_logprobs
    for case, (episode, tool, chat), (again, _, _) in episodes:
        assert chat.route == prompt_ids_route(vllm.__version__) == "chat"  # 0.32: ids through the chat endpoint
        assert_exact_ids(episode, tool, tokenizer, case, MAX_TURNS)
        assert_trainer_logprobs(policy, episode, case["temperature"])
        assert again.served == episode.served  # an episode replays bit for bit
    samples = [turn.token_ids for _, (episode, _, _), _ in episodes for turn in episode.served]
    assert len({tuple(s) for s in samples}) == len(samples)  # turns and episodes sample apart


@pytest.mark.slow
def test_text_round_trip_runs_on_other_ids(episodes):
    """The control: the same last turns asked with the earlier turns as text run on other prompt ids, and so
    sample other ids or log-probs, than the exact path did."""
    from serve_episodes_shared import text_round_trip
    for case, (episode, tool, chat), _ in episodes:
        exact = episode.served[-1]
        text = text_round_trip(chat, case, episode, tool)
        assert text.prompt_ids != exact.prompt_ids, "the text round trip kept the ids: this control cannot fail"
        assert (text.token_ids, text.logprobs) != (exact.token_ids, exact.logprobs)


@pytest.mark.slow
def test_completions_route_gives_the_same_episode(server, checkpoint, tokenizer, episodes):
    """ServedChat(route="completions") (how 0.25 servers continue: /v1/completions with an id prompt) runs
    the same turns, bit for bit, as the chat endpoint's ids field."""
    from serve_episodes_shared import ReversingTool, openai_client
    case, (episode, _, _), _ = episodes[0]
    chat = ServedChat(openai_client(server), checkpoint, max_tokens=case["max_tokens"],
                      temperature=case["temperature"], top_p=case["top_p"], route="completions")
    again = run_chat_episode(chat, [{"role": "user", "content": case["user"]}], ReversingTool(chat, tokenizer),
                             MAX_TURNS, case["seed"])
    strip = [(t.prompt_ids, t.token_ids, t.logprobs, t.finish_reason) for t in episode.served]
    assert [(t.prompt_ids, t.token_ids, t.logprobs, t.finish_reason) for t in again.served] == strip


def test_prompt_ids_route_by_version():
    assert [prompt_ids_route(v) for v in ("0.25.0", "0.25.1+cu129", "0.31.2", "0.32.0", "0.32.0+cpu", "v1.0.0")] == \
        ["completions", "completions", "completions", "chat", "chat", "chat"]
    assert parse_version("0.26.0rc1.dev3+g1a2b") == (0, 26)
    with pytest.raises(ValueError, match="not a vLLM version"):
        parse_version("dev")
    assert chat_ids_fields([3, 4]) == ([], {"kv_transfer_params": {"prompt_token_ids": [3, 4]}})


# --- the client against a fake server --------------------------------------------------------------------

def _fake_client(routes: dict):
    """An OpenAI client whose server answers `routes[path](json body or None)` -> (status, JSON)."""
    from openai import OpenAI

    def handle(request: httpx.Request) -> httpx.Response:
        body = json.loads(request.content) if request.content else None
        if request.url.path not in routes:
            return httpx.Response(404, json={"detail": "Not Found"})
        status, answer = routes[request.url.path](body)
        return httpx.Response(status, json=answer)
    return OpenAI(base_url="http://fake/v1", api_key="unused", max_retries=0,
                  http_client=httpx.Client(transport=httpx.MockTransport(handle)))


def _chat_answer(prompt_ids=None, token_ids=None, logprobs=(-1.0, -2.0)):
    choice = {"index": 0, "message": {"role": "assistant", "content": "ab"}, "finish_reason": "length",
              "logprobs": {"content": [{"token": "a", "logprob": lp, "bytes": [97], "top_logprobs": []}
                                       for lp in logprobs]}}
    out = {"id": "c", "object": "chat.completion", "created": 0, "model": "m", "choices": [choice]}
    if prompt_ids is not None:
        out["prompt_token_ids"] = prompt_ids
    if token_ids is not None:
        choice["token_ids"] = token_ids
    return out


VERSION_32 = {"/version": lambda _: (200, {"version": "0.32.0"})}


def test_server_without_token_ids_is_refused():
    """An OpenAI server that ignores return_token_ids (not vLLM, or a vLLM without the field)."""
    chat = ServedChat(_fake_client({**VERSION_32, "/v1/chat/completions": lambda _: (200, _chat_answer())}),
                      "m", max_tokens=2)
    with pytest.raises(ServedIdsError, match="returned no token ids.*return_token_ids"):
        chat.first_turn([{"role": "user", "content": "ab"}], seed=1)
    answer = _chat_answer(prompt_ids=[1, 11, 0, 2], token_ids=[5, 6], logprobs=(-1.0,))
    chat = ServedChat(_fake_client({**VERSION_32, "/v1/chat/completions": lambda _: (200, answer)}), "m", max_tokens=2)
    with pytest.raises(ServedIdsError, match="2 sampled ids came with 1 log-probs"):
        chat.first_turn([{"role": "user", "content": "ab"}], seed=1)


def test_server_that_does_not_read_the_ids_is_refused():
    """A server that takes the ids field but renders the (empty) messages instead, as 0.25 would."""
    seen = []

    def chat_endpoint(body):
        seen.append(body)
        return 200, _chat_answer(prompt_ids=[2], token_ids=[5, 6])
    chat = ServedChat(_fake_client({**VERSION_32, "/v1/chat/completions": chat_endpoint}), "m", max_tokens=2)
    assert chat.route == "chat"
    with pytest.raises(ServedIdsError, match="ran on 1 prompt ids that are not the 3 sent.*route='completions'"):
        chat.next_turn([1, 11, 2], seed=1)
    assert seen[0]["messages"] == [] and seen[0]["kv_transfer_params"] == {"prompt_token_ids": [1, 11, 2]}
    assert seen[0]["return_token_ids"] is True and seen[0]["logprobs"] is True and seen[0]["seed"] == 1


def test_server_without_a_version_is_refused_unless_the_route_is_given():
    routes = {"/v1/chat/completions": lambda _: (200, _chat_answer())}
    with pytest.raises(ServedIdsError, match=r"GET http://fake/version .*failed.*is this a vLLM server"):
        ServedChat(_fake_client(routes), "m", max_tokens=2)
    assert ServedChat(_fake_client(routes), "m", max_tokens=2, route="completions").route == "completions"
    with pytest.raises(ValueError, match="route must be one of"):
        ServedChat(_fake_client(routes), "m", max_tokens=2, route="text")
    old = {"/version": lambda _: (200, {"version": "0.25.0"})}
    assert ServedChat(_fake_client(old), "m", max_tokens=2).route == "completions"


def _tokenize_with(tokenizer, template):
    """A fake /tokenize: the chat template rendered by transformers, then the tokenizer."""
    def tokenize(body):
        text = tokenizer.apply_chat_template(body["messages"], chat_template=template, tokenize=False,
                                             add_generation_prompt=body.get("add_generation_prompt", True),
                                             continue_final_message=body.get("continue_final_message", False))
        return 200, {"tokens": tokenizer(text, add_special_tokens=False)["input_ids"]}
    return tokenize


def test_after_turn_closes_the_turn_once(tokenizer):
    """A tool message's ids: the template's end of turn (unless the model sampled it), the message, the next
    generation prompt; a template that does not continue the conversation is refused."""
    from serve_episodes_shared import ASSISTANT, END, TOOL
    chat = ServedChat(_fake_client({**VERSION_32, "/tokenize": _tokenize_with(tokenizer, ROLE_TEMPLATE)}), "m",
                      max_tokens=2)
    message = [{"role": "tool", "content": "fab"}]
    tool_ids = tokenizer("fab")["input_ids"]
    assert chat.after_turn([11, 12], message) == [END, TOOL, *tool_ids, END, ASSISTANT]
    assert chat.after_turn([11, END], message) == [TOOL, *tool_ids, END, ASSISTANT]
    reversed_template = ROLE_TEMPLATE.replace("in messages", "in messages|reverse")
    chat = ServedChat(_fake_client({**VERSION_32, "/tokenize": _tokenize_with(tokenizer, reversed_template)}), "m",
                      max_tokens=2)
    with pytest.raises(ServedIdsError, match="does not render messages after an assistant turn"):
        chat.after_turn([11, 12], message)
