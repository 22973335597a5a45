"""Token ids through vLLM's OpenAI server, version by version: what the server offers, and the one place
a client (recipes/openai_episodes.py) learns which field carries a prompt's ids. Imports no vLLM.

In 0.25 and 0.32 alike:
- `return_token_ids: true` on /v1/chat/completions adds the templated prompt's ids (`prompt_token_ids`,
  top level) and each choice's sampled ids (`choices[i].token_ids`, with the stop token where the model
  stopped on one); on /v1/completions each choice carries both.
- /v1/completions takes `prompt` as a list of token ids and runs them as given.
- /tokenize takes chat `messages` (with add_generation_prompt, continue_final_message,
  chat_template_kwargs) and returns the ids the server's template and tokenizer make of them.
- A chat message holds text or media only: the OpenAI message format has no token-id content.
- Tokens in, tokens out outside the OpenAI API: POST /inference/v1/generate (`token_ids` and vLLM
  SamplingParams); 0.25 serves it whenever the model generates, 0.32 only under `--enable-scale-out`
  (a 403 otherwise), as with /v1/chat/completions/render.
0.32 only: a chat request's `kv_transfer_params: {"prompt_token_ids": [...]}` (added for prefill/decode
disaggregation, vLLM PR #48145) is the prompt: no template, no tokenizer, the messages unread. vLLM
ignores the ids when `echo` is set or a message holds media.
0.25: chat requests take `kv_transfer_params` but do not read ids in it; the messages are rendered.

Rule: a continuing turn goes through the chat endpoint where the server's version reads the ids field
(CHAT_IDS_SINCE), else through /v1/completions with the ids as its prompt. Versions between 0.25 and 0.32
take the completions route: it reads ids in every version. Either way the client checks each answer's
`prompt_token_ids` against the ids it sent, so a server that drops the field fails loudly.
"""
from __future__ import annotations

import re

CHAT_IDS_SINCE = (0, 32)  # the first version checked to read kv_transfer_params["prompt_token_ids"]
ROUTES = ("chat", "completions")


def parse_version(text: str) -> tuple[int, int]:
    """(major, minor) of a vLLM version string ("0.32.0", "0.25.1+cu129", "0.26.0rc1.dev3+g1a2b")."""
    found = re.match(r"\s*v?(\d+)\.(\d+)", str(text))
    if found is None:
        raise ValueError(f"not a vLLM version: {text!r}")
    return int(found[1]), int(found[2])


def prompt_ids_route(version: str) -> str:
    """"chat" where the server's chat endpoint reads a prompt's ids, else "completions"."""
    return "chat" if parse_version(version) >= CHAT_IDS_SINCE else "completions"


def chat_ids_fields(ids: list[int]) -> tuple[list, dict]:
    """(messages, extra body fields) of a chat request whose prompt is `ids` (CHAT_IDS_SINCE on). The
    messages are empty: the server does not read them, and one that ignored the ids would render an empty
    conversation, never ours, so the client's check of the prompt ids catches it."""
    return [], {"kv_transfer_params": {"prompt_token_ids": list(ids)}}
