"""Tiny Hugging Face chat templates of both kinds, a tokenizer to carry them, and a chat environment that
renders with them (tests/test_templates.py).

The tokenizer is word-level over whitespace: specials, `<think>` / `</think>`, and words w0..w15, so that
any ids decode to text that encodes back to the same ids (the environment's renders are exact, and where a
template keeps history its render of a conversation is the episode's trajectory token for token).

Both templates are a thinking model's: the generation prompt opens `<think>`, the model writes its
reasoning, `</think>`, then its answer, and ends its turn with `<eos>`. They differ in what they render of
an earlier assistant turn:
- KEEP_HISTORY renders it as the model saw it (`<assistant> <think>` and everything it sampled);
- DROP_THINK, as Qwen3's template does, renders an assistant turn before the last user message as its
  answer alone: `<assistant>` and the text after its last `</think>`, no `<think>`.
`{% generation %}` marks the assistant's tokens (return_assistant_tokens_mask), as a trainer that scores
rendered conversations would read them.
"""
from __future__ import annotations

from recipes.environment import EnvStep

SPECIAL = ["<unk>", "<pad>", "<eos>", "<user>", "<assistant>", "<tool>"]
THINK = ["<think>", "</think>"]
WORDS = [f"w{i}" for i in range(16)]

_MESSAGES = """
{%- for m in messages -%}
{%- if m.role == 'assistant' and loop.index0 < ns.last_user -%}
<assistant> {% generation %}{{ ANSWER }}<eos>{% endgeneration %} {% elif m.role == 'assistant' -%}
<assistant> <think> {% generation %}{{ m.content }}<eos>{% endgeneration %} {% else -%}
<{{ m.role }}> {{ m.content }} <eos> {% endif -%}
{%- endfor -%}
{%- if add_generation_prompt -%}<assistant> <think> {% endif -%}"""

# last_user = -1: no assistant turn is before it, every one is rendered whole
KEEP_HISTORY = "{%- set ns = namespace(last_user=-1) -%}" + _MESSAGES.replace("{{ ANSWER }}", "{{ m.content }}")

DROP_THINK = """{%- set ns = namespace(last_user=-1) -%}
{%- for m in messages -%}{%- if m.role == 'user' -%}{%- set ns.last_user = loop.index0 -%}{%- endif -%}{%- endfor -%}
""" + _MESSAGES.replace("{{ ANSWER }}", "{{ m.content.split('</think>')[-1].strip() }}")

TEMPLATES = {"keep_history": KEEP_HISTORY, "drop_think": DROP_THINK}


def save_tokenizer(path, chat_template: str):
    """The word-level tokenizer with `chat_template`, saved with save_pretrained and loaded back the way a
    checkpoint's is."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    vocab = {t: i for i, t in enumerate(SPECIAL + THINK + WORDS)}
    core = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok = PreTrainedTokenizerFast(tokenizer_object=core, unk_token="<unk>", pad_token="<pad>", eos_token="<eos>",
                                  additional_special_tokens=["<user>", "<assistant>", "<tool>"])
    tok.add_tokens(THINK)  # not special: they are text of the model's turns (kept in decodes)
    tok.chat_template = chat_template
    tok.save_pretrained(path)
    return AutoTokenizer.from_pretrained(path)


class ChatEnv:
    """A chat whose observations are messages rendered by the tokenizer's chat template.

    Each turn's assistant message is the model's ids decoded (its trailing `<eos>` left to the template);
    the next message's role follows `roles` in turn (a "user" message after the first makes DROP_THINK
    rewrite the turns before it), its words a function of the model's first token, so later turns depend
    on what was sampled. done after `turns` turns, with a per-turn reward from the model's tokens.

    whole_context=False: the observation is the delta, the render of the conversation minus the render up
    to the model's message (a template that keeps history; a render that does not extend raises), and an
    `<eos>` first where the model's turn ran out before sampling it. True: the whole next context as the
    template renders it. `renders` holds the template's render (generation prompt included) of the
    conversation before every turn, as ids."""

    def __init__(self, tokenizer, whole_context: bool, turns: int = 4, roles: tuple[str, ...] = ("tool", "user")):
        self.tok, self.whole_context, self.turns, self.roles = tokenizer, whole_context, turns, roles
        self.eos = tokenizer.eos_token_id
        self.messages: list[dict] = []
        self.renders: list[list[int]] = []
        self.sampled: list[list[int]] = []

    @staticmethod
    def reward_of(model_tokens: list[int]) -> float:
        """A turn's reward: the share of its ids divisible by 3 (episodes of a prompt differ in it)."""
        return sum(t % 3 == 0 for t in model_tokens) / max(1, len(model_tokens))

    def render(self, messages, generation_prompt: bool) -> str:
        return self.tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=generation_prompt)

    def encode(self, text: str) -> list[int]:
        return self.tok.encode(text, add_special_tokens=False)

    def reset(self, row: dict) -> list[int]:
        self.messages = [{"role": "user", "content": row["text"]}]
        self.renders = [self.encode(self.render(self.messages, True))]
        return list(self.renders[0])

    def step(self, model_tokens: list[int]) -> EnvStep:
        self.sampled.append(list(model_tokens))
        stopped = bool(model_tokens) and model_tokens[-1] == self.eos
        content = model_tokens[:-1] if stopped else model_tokens
        self.messages.append({"role": "assistant", "content": self.tok.decode(content)})
        reward = self.reward_of(model_tokens)
        if len(self.sampled) == self.turns:
            return EnvStep(reward=reward, done=True)
        first = model_tokens[0] if model_tokens else 0
        words = " ".join(WORDS[(first + k) % len(WORDS)] for k in range(3))
        before = self.render(self.messages, False)
        self.messages.append({"role": self.roles[(len(self.sampled) - 1) % len(self.roles)], "content": words})
        after = self.render(self.messages, True)
        self.renders.append(self.encode(after))
        if self.whole_context:
            return EnvStep(reward=reward, context=self.encode(after))
        if not after.startswith(before):
            raise ValueError("the template rewrote history: it has no delta to observe")
        return EnvStep(reward=reward, observation=([] if stopped else [self.eos]) + self.encode(after[len(before):]))
