"""Multi-turn episodes against a `vllm serve` OpenAI server (ours: rollout_service.vllm.plugin.serve), each turn
continuing from the exact token ids so far, with the official `openai` client.

    from openai import OpenAI
    chat = ServedChat(OpenAI(base_url="http://HOST:8000/v1", api_key="-"), MODEL, max_tokens=64, temperature=0.7)
    episode = run_chat_episode(chat, [{"role": "user", "content": "..."}], env, max_turns=4, seed=5)

The first turn is an ordinary chat request (`return_token_ids`, `logprobs`): the server's chat template renders
the messages, and the answer carries the prompt's ids and the model's. Every later turn's prompt is the ids so
far: the previous prompt, the model's ids as sampled, then the environment's observation ids. They go back as ids
through the field the server's vLLM version reads (rollout_service/vllm/openai_ids.py): the chat endpoint's
`kv_transfer_params.prompt_token_ids` (0.32), else /v1/completions' id prompt (0.25). No text is sent back, so
nothing is detokenized and tokenized again: sampled text re-encodes into other ids (tokenizers merge and split
across token boundaries), and the trainer would score a context no turn ran on.

Rules:
- Every answer must say which ids it ran on and which it sampled (vLLM's `return_token_ids`), and the ids it
  ran on must be the ones sent. A server that returns no ids (not vLLM, or a vLLM without return_token_ids)
  or ran on others (one that does not read the field) raises ServedIdsError: an episode the trainer cannot
  reproduce is never recorded.
- The environment is recipes.environment's: step(model token ids) -> EnvStep with observation token ids
  (EpisodeEnd and failures end the episode as in recipes/episodes.py). One that answers with chat messages
  (a tool's output) gets their ids from `chat.after_turn(model_tokens, messages)`: what the server's chat
  template puts after an assistant turn when `messages` follow, the next generation prompt included. The
  model's earlier turns stay as sampled even where the template would render history otherwise.
- Each turn has its own seed, derived from the episode's (turn_seed), so an episode replays bit for bit.

The result is a recipes.episodes.Episode (every token after the first prompt, model tokens masked in) with
`served`, each turn as the server answered it. Under our plugin each model token's log-prob is the one the
trainer's canonical forward gives when it scores the whole trajectory in one forward.
"""
from __future__ import annotations

import hashlib
from dataclasses import dataclass, field

from rollout_service.vllm.openai_ids import ROUTES, chat_ids_fields, prompt_ids_route

from .episodes import Episode, Segment, _step

# a conversation that the messages after an assistant turn are rendered against (after_turn)
_PLACEHOLDER = [{"role": "user", "content": "x"}, {"role": "assistant", "content": "x"}]


class ServedIdsError(RuntimeError):
    """The server's answer cannot be recorded as exact ids: none returned, or not the ids sent."""


@dataclass(frozen=True)
class ServedTurn:
    prompt_ids: list[int]  # the ids the server says it ran on (its prompt_token_ids)
    token_ids: list[int]  # the model's ids as sampled
    logprobs: list[float]  # one per sampled id
    finish_reason: str
    text: str  # the server's detokenization of token_ids: to read, never to send back
    weight_versions: list[int] | None = None  # unknown over the API (Episode.add_turn reads it)


@dataclass
class ServedEpisode(Episode):
    served: list[ServedTurn] = field(default_factory=list)


def turn_seed(seed: int, turn: int) -> int:
    """A 63-bit sampling seed for one turn of the episode with `seed`."""
    key = f"openai-episode/{seed}/{turn}".encode()
    return int.from_bytes(hashlib.blake2b(key, digest_size=8).digest(), "little") & (2 ** 63 - 1)


class ServedChat:
    """One model on one server, sampling with fixed fields: `max_tokens` per turn, `temperature`, `top_p`,
    and `extra_body` for vLLM's own fields (ignore_eos, top_k, stop_token_ids, ...). `route` ("chat" or
    "completions") is how continuing turns send their ids; by default the server's version decides."""

    def __init__(self, client, model: str, *, max_tokens: int, temperature: float = 1.0, top_p: float | None = None,
                 extra_body: dict | None = None, chat_template_kwargs: dict | None = None, route: str | None = None):
        self.client, self.model, self.max_tokens = client, model, max_tokens
        self.sampling = {"temperature": temperature, **({} if top_p is None else {"top_p": top_p})}
        self.extra_body = {**(extra_body or {}), "return_token_ids": True}
        self.template_kwargs = {"chat_template_kwargs": chat_template_kwargs} if chat_template_kwargs else {}
        base = str(client.base_url).rstrip("/")
        self.root = base.removesuffix("/v1")
        if route is None:
            version = self._root_json("get", "/version", "vLLM's version").get("version")
            if not isinstance(version, str):
                raise ServedIdsError(f"GET {self.root}/version names no vLLM version: {version!r}")
            route = prompt_ids_route(version)
        if route not in ROUTES:
            raise ValueError(f"route must be one of {ROUTES}, got {route!r}")
        self.route = route
        self._max_model_len = None
        self._head = None  # the placeholder conversation's ids up to the end of its assistant turn's content

    @property
    def max_model_len(self) -> int:
        """The server's context length for this model (GET /v1/models)."""
        if self._max_model_len is None:
            served = {m.id: getattr(m, "max_model_len", None) for m in self.client.models.list().data}
            if served.get(self.model) is None:
                raise ServedIdsError(f"GET /v1/models names no max_model_len for {self.model!r}: {served}")
            self._max_model_len = int(served[self.model])
        return self._max_model_len

    def first_turn(self, messages: list[dict], seed: int, max_tokens: int | None = None) -> ServedTurn:
        """The model's turn after `messages`, rendered by the server's chat template."""
        out = self.client.chat.completions.create(
            model=self.model, messages=messages, seed=seed, n=1, logprobs=True,
            max_tokens=max_tokens or self.max_tokens, **self.sampling,
            extra_body={**self.extra_body, **self.template_kwargs})
        return _chat_turn(out, sent=None)

    def next_turn(self, ids: list[int], seed: int, max_tokens: int | None = None) -> ServedTurn:
        """The model's turn after the prompt `ids`, sent as ids."""
        if self.route == "chat":
            messages, ids_field = chat_ids_fields(ids)
            out = self.client.chat.completions.create(
                model=self.model, messages=messages, seed=seed, n=1, logprobs=True,
                max_tokens=max_tokens or self.max_tokens, **self.sampling, extra_body={**self.extra_body, **ids_field})
            return _chat_turn(out, sent=ids)
        out = self.client.completions.create(
            model=self.model, prompt=list(ids), seed=seed, n=1, logprobs=0, max_tokens=max_tokens or self.max_tokens,
            **self.sampling, extra_body=self.extra_body)
        choice = out.choices[0]
        lps = choice.logprobs.token_logprobs if choice.logprobs is not None else None
        return _checked_turn(getattr(choice, "prompt_token_ids", None), choice, lps, choice.text, ids)

    def after_turn(self, model_tokens: list[int], messages: list[dict]) -> list[int]:
        """The ids that follow the model's turn `model_tokens` when `messages` come next: what the server's
        chat template puts after an assistant message's content (its end of turn, the messages, the next
        generation prompt). Rendered around a placeholder turn, so the model's ids are never re-encoded. A
        model that stopped on the end-of-turn token sampled it already: it is not repeated."""
        if self._head is None:
            self._head = self._tokenize(_PLACEHOLDER, add_generation_prompt=False, continue_final_message=True)
        head = self._head
        full = self._tokenize(_PLACEHOLDER + list(messages), add_generation_prompt=True)
        if full[:len(head)] != head:
            raise ServedIdsError("the server's chat template does not render messages after an assistant turn as "
                                 f"a continuation of it ({head} is not a prefix of {full}): their ids cannot follow "
                                 "the model's exact ids")
        delta = full[len(head):]
        if model_tokens and delta and model_tokens[-1] == delta[0]:
            delta = delta[1:]
        return delta

    def _tokenize(self, messages: list[dict], **flags) -> list[int]:
        body = {"model": self.model, "messages": messages, **flags, **self.template_kwargs}
        return list(self._root_json("post", "/tokenize", "the chat template's ids", body)["tokens"])

    def _root_json(self, method: str, path: str, what: str, body: dict | None = None) -> dict:
        import httpx
        import openai
        try:
            call = getattr(self.client, method)
            answer = call(self.root + path, cast_to=httpx.Response, **({} if body is None else {"body": body})).json()
        except (openai.APIStatusError, ValueError) as e:
            answer = e
        if not isinstance(answer, dict):
            raise ServedIdsError(f"{method.upper()} {self.root}{path} ({what}) failed: {answer}; is this a vLLM "
                                 "server? (a known version can be given as ServedChat(route=...))")
        return answer


def _chat_turn(out, sent: list[int] | None) -> ServedTurn:
    choice = out.choices[0]
    content = choice.logprobs.content if choice.logprobs is not None else None
    lps = None if content is None else [t.logprob for t in content]
    return _checked_turn(getattr(out, "prompt_token_ids", None), choice, lps, choice.message.content or "", sent)


def _checked_turn(prompt_ids, choice, logprobs, text: str, sent: list[int] | None) -> ServedTurn:
    token_ids = getattr(choice, "token_ids", None)
    if prompt_ids is None or token_ids is None:
        raise ServedIdsError("the server returned no token ids (prompt_token_ids, choices[].token_ids): it needs "
                             "vLLM's `return_token_ids` request field (a vLLM server recent enough to have it)")
    if sent is not None and list(prompt_ids) != list(sent):
        raise ServedIdsError(f"the server ran on {len(prompt_ids)} prompt ids that are not the {len(sent)} sent: "
                             "it did not read the ids' field (an older vLLM?); use ServedChat(route='completions')")
    if logprobs is None or len(logprobs) != len(token_ids):
        raise ServedIdsError(f"{len(token_ids)} sampled ids came with "
                             f"{'no' if logprobs is None else len(logprobs)} log-probs")
    return ServedTurn(list(prompt_ids), list(token_ids), [float(x) for x in logprobs], choice.finish_reason or "",
                      text or "")


def run_chat_episode(chat: ServedChat, messages: list[dict], env, max_turns: int, seed: int) -> ServedEpisode:
    """One episode of at most `max_turns` model turns after `messages`; `env.step(model token ids) -> EnvStep`
    answers each (recipes.environment.Environment's step). Ends as recipes/episodes.py's do: "done", an
    EpisodeEnd's reason, an environment error, no room left in the server's context, or "max turns"."""
    if max_turns < 1:
        raise ValueError(f"max_turns must be >= 1, got {max_turns}")
    ep = None
    for turn in range(max_turns):
        if ep is None:
            served = chat.first_turn(messages, turn_seed(seed, turn))
            ep = ServedEpisode(segments=[Segment(prompt_ids=list(served.prompt_ids))])
        else:
            room = chat.max_model_len - len(ep.context)
            if room <= 0:
                ep.end = f"max_model_len: the context holds {len(ep.context)} tokens"
                break
            served = chat.next_turn(ep.context, turn_seed(seed, turn), max_tokens=min(chat.max_tokens, room))
        ep.served.append(served)
        ep.add_turn(served)
        _step(env, ep, list(served.token_ids), chat.max_model_len)
        if ep.end is not None:
            break
    if ep.end is None:
        ep.end = "max turns"
    return ep
