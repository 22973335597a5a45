"""SeedEcho: the plugin server's ASGI middleware (vLLM's `--middleware`) that makes every sampling request
replayable. A completion or chat request without a seed gets a fresh one written into its body before
vLLM reads it, and every such request's seed comes back in the `x-zerokl-seed` response header (with
the OpenAI client: `client.completions.with_raw_response.create(...).headers["x-zerokl-seed"]`).

Rule: the seed is chosen here, at the HTTP edge, not in the engine, because only here can the client be
told it: the engine's request rule (sampling.canonical_request) then sees an ordinary seeded request, and
its n samples take seed + index as for any seeded one. Bodies that are not a JSON object, and seeds that
are not integers, pass through untouched for vLLM to refuse.

A 404 for a model the server does not serve gets the server's model name added (model_hint): vLLM serves
a checkpoint under its path, which a client asking for a hub name does not guess.
"""
from __future__ import annotations

import json
import secrets

from rollout_service.vllm.plugin.model_hint import model_hint, server_args, with_model_hint

SEED_HEADER = "x-zerokl-seed"
SAMPLING_PATHS = ("/v1/completions", "/v1/chat/completions")
SEED_BITS = 62  # room for seed + n below 2**63 (sampling.canonical_request)
XARGS_SEED = "zerokl_seed"  # sampling.XARGS_PREFIX + "seed"; that module imports torch, this one stays light
NOT_FOUND = 404


def with_seed(body: bytes) -> tuple[bytes, int | None]:
    """(the body to hand to vLLM, the request's seed): a JSON object without a seed (or with null) gets a
    fresh one, unless vllm_xargs names zerokl_seed (that one is the request's); a body that is not a JSON
    object, or whose seed is not an integer, is returned as it was, with no seed."""
    try:
        payload = json.loads(body)
    except ValueError:
        return body, None
    if not isinstance(payload, dict):
        return body, None
    xargs = payload.get("vllm_xargs")
    if isinstance(xargs, dict) and XARGS_SEED in xargs:  # our own field names the seed, and wins
        return body, _integer(xargs[XARGS_SEED])
    if payload.get("seed") is None:
        payload["seed"] = seed = secrets.randbelow(1 << SEED_BITS)
        return json.dumps(payload).encode(), seed
    return body, _integer(payload["seed"])


def _integer(value) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) else None


class SeedEcho:
    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or scope["method"] != "POST" or scope["path"] not in SAMPLING_PATHS:
            return await self.app(scope, receive, send)
        chunks, more = [], True
        while more:
            message = await receive()
            if message["type"] != "http.request":  # the client left before sending its body
                return await self.app(scope, _replay([message], receive), send)
            chunks.append(message.get("body", b""))
            more = message.get("more_body", False)
        body, seed = with_seed(b"".join(chunks))
        headers = [(k, v) for k, v in scope["headers"] if k.lower() != b"content-length"]
        scope = {**scope, "headers": [*headers, (b"content-length", str(len(body)).encode())]}

        async def send_with_seed(message):
            if message["type"] == "http.response.start" and seed is not None:
                message = {**message, "headers": [*message.get("headers", []),
                                                  (SEED_HEADER.encode(), str(seed).encode())]}
            await send(message)

        await self.app(scope, _replay([{"type": "http.request", "body": body, "more_body": False}], receive),
                       _hinting_not_found(send_with_seed, model_hint(server_args(scope))))


def _hinting_not_found(send, hint: str):
    """An ASGI send that adds `hint` to vLLM's unknown-model 404: a 404's start is held until its whole body
    is read, then both go out, the body rewritten (with_model_hint) and its content-length with it. Other
    responses go out as they come: a stream stays a stream."""
    held = {}  # a 404's start message and the body chunks read so far

    async def hinting(message):
        if message["type"] == "http.response.start" and message["status"] == NOT_FOUND:
            held.update(start=message, chunks=[])
            return
        if "start" not in held or message["type"] != "http.response.body":
            return await send(message)
        held["chunks"].append(message.get("body", b""))
        if message.get("more_body", False):
            return
        body = with_model_hint(b"".join(held["chunks"]), hint)
        start = held.pop("start")
        headers = [(k, v) for k, v in start.get("headers", []) if k.lower() != b"content-length"]
        await send({**start, "headers": [*headers, (b"content-length", str(len(body)).encode())]})
        await send({"type": "http.response.body", "body": body, "more_body": False})
    return hinting


def _replay(messages: list[dict], receive):
    """An ASGI receive that hands out `messages` first, then the connection's own (a disconnect)."""
    pending = list(messages)

    async def replayed():
        return pending.pop(0) if pending else await receive()
    return replayed
