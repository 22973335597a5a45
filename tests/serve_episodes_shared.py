"""Multi-turn episodes through `vllm serve` with the OpenAI client, shared by the CPU test
(test_vllm_serve_multiturn.py) and its GPU twin (gpu/test_vllm_serve_multiturn_gpu.py): a tool that answers
every model turn with a chat message, the checks that each turn continued from the exact ids, the trainer's
one forward over the trajectory, and the text round trip the exact path replaces."""
from __future__ import annotations

import numpy as np
import torch

import trainer_patch
from recipes.environment import EnvStep
from recipes.openai_episodes import ServedChat, run_chat_episode, turn_seed
from serve_shared import ROLE_SPECIALS

END, USER, ASSISTANT, TOOL = range(len(ROLE_SPECIALS))


class ReversingTool:
    """Answers each model turn with a tool message, the turn's text reversed (at most 5 letters): it decodes
    the model's ids to read them, never encodes them; the message's ids are the server template's
    (ServedChat.after_turn). Keeps the messages and observation ids it gave, in turn."""

    def __init__(self, chat: ServedChat, tokenizer):
        self.chat, self.tok = chat, tokenizer
        self.messages, self.observations = [], []

    def step(self, model_tokens: list[int]) -> EnvStep:
        text = self.tok.decode(model_tokens, skip_special_tokens=True)
        message = {"role": "tool", "content": text[::-1][:5] or "a"}
        ids = self.chat.after_turn(model_tokens, [message])
        self.messages.append(message)
        self.observations.append(ids)
        return EnvStep(observation=ids)


def openai_client(base):
    from openai import OpenAI
    return OpenAI(base_url=base + "/v1", api_key="unused", max_retries=0)


def run_tool_episode(base, model, tokenizer, case: dict, max_turns: int):
    """(episode, tool, chat) of one episode: case holds the user's text, seed, temperature, top_p, max_tokens."""
    chat = ServedChat(openai_client(base), model, max_tokens=case["max_tokens"], temperature=case["temperature"],
                      top_p=case["top_p"])
    tool = ReversingTool(chat, tokenizer)
    episode = run_chat_episode(chat, [{"role": "user", "content": case["user"]}], tool, max_turns, case["seed"])
    return episode, tool, chat


def assert_exact_ids(episode, tool, tokenizer, case: dict, max_turns: int) -> None:
    """The ids each turn ran on (the server's prompt_token_ids) are the previous turn's prompt, its sampled ids
    and the tool's observation; the first prompt is the template over the user's text; each observation is the
    template's tool message, after the end-of-turn token the model did not sample itself."""
    served = episode.served
    assert episode.end == "max turns" and len(served) == episode.turns == max_turns, (episode.end, len(served))
    assert len(tool.observations) == max_turns
    assert served[0].prompt_ids == [USER, *tokenizer(case["user"])["input_ids"], END, ASSISTANT]
    for k in range(1, max_turns):
        assert served[k].prompt_ids == served[k - 1].prompt_ids + served[k - 1].token_ids + tool.observations[k - 1], k
    for turn, message, observed in zip(served, tool.messages, tool.observations):
        closing = [] if turn.token_ids[-1] == END else [END]
        assert observed == [*closing, TOOL, *tokenizer(message["content"])["input_ids"], END, ASSISTANT]
    assert episode.context == served[-1].prompt_ids + served[-1].token_ids + tool.observations[-1]
    assert len(episode.segments) == 1  # the tool's answers append to the context: one sample per episode
    segment = episode.segments[0]
    model_ids = [t for t, m in zip(segment.token_ids, segment.model_mask) if m]
    assert model_ids == [t for turn in served for t in turn.token_ids]


def assert_trainer_logprobs(policy, episode, temperature: float) -> None:
    """Every model token's log-prob is the trainer's from one forward over the whole trajectory."""
    device = next(policy.parameters()).device
    with torch.no_grad():
        scored = trainer_patch.token_logprobs(policy, torch.tensor([episode.context], device=device),
                                              temperature=temperature)[0].tolist()
    (segment,) = episode.segments  # one sample: every turn continued the same context
    start = len(segment.prompt_ids)  # scored[i] is the log-prob of context[i + 1]
    expected = [scored[start + i - 1] for i, m in enumerate(segment.model_mask) if m]
    served = [lp for lp, m in zip(segment.logprobs, segment.model_mask) if m]
    assert served == expected
    assert np.array_equal(np.float32(served), np.float32(expected))


def text_round_trip(chat: ServedChat, case: dict, episode, tool):
    """The last turn as a client that sends text would ask for it: the user's message, then every earlier turn
    as the assistant's text (the server's detokenization) and the tool's message, with the exact turn's seed.
    Returns the served turn (its prompt ids are what the server's tokenizer made of the text)."""
    messages = [{"role": "user", "content": case["user"]}]
    for turn, message in zip(episode.served[:-1], tool.messages):
        messages += [{"role": "assistant", "content": turn.text}, message]
    last = len(episode.served) - 1
    return chat.first_turn(messages, turn_seed(case["seed"], last))
