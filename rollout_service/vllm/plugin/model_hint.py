"""The hint added to vLLM's 404 for a model the server does not serve (SeedEcho applies it).

`vllm serve CHECKPOINT` serves the model under the checkpoint's path unless `--served-model-name` names
it, so a client asking for "Qwen/Qwen2.5-1.5B" gets "The model `Qwen/Qwen2.5-1.5B` does not exist". The
hint says which name the server answers to and how to choose one.

Rule: only a JSON body whose message says a model does not exist is rewritten, in vLLM 0.32's shape
({"error": {"message": ...}}) or the flat one of earlier versions ({"message": ...}); any other body is
returned as it was. The served name comes from vLLM's parsed arguments (`app.state.args`); where a
version keeps none there, the hint says where the name comes from instead.
"""
from __future__ import annotations

import json


def model_hint(args) -> str:
    """The hint for a server started with vLLM's parsed arguments `args` (None: not known)."""
    if args is None or not getattr(args, "model", None):
        return ("this server's model name is its --served-model-name, else the checkpoint path it was "
                "started with (GET /v1/models lists it)")
    names = getattr(args, "served_model_name", None)
    if names:
        return f"this server's model names are {', '.join(repr(n) for n in names)} (its --served-model-name)"
    return (f"this server serves the checkpoint path '{args.model}' as its model name; pass "
            f"--served-model-name NAME to choose one")


def server_args(scope) -> object | None:
    """vLLM's parsed arguments, kept on the app's state (Starlette puts the app in every scope)."""
    return getattr(getattr(scope.get("app"), "state", None), "args", None)


def with_model_hint(body: bytes, hint: str) -> bytes:
    """`body` with the hint after its message if it is vLLM's unknown-model error, else `body`."""
    try:
        payload = json.loads(body)
    except ValueError:
        return body
    if not isinstance(payload, dict):
        return body
    error = payload["error"] if isinstance(payload.get("error"), dict) else payload
    message = error.get("message")
    if not (isinstance(message, str) and message.startswith("The model") and "does not exist" in message):
        return body
    error["message"] = f"{message} Note: {hint}."
    return json.dumps(payload).encode()
