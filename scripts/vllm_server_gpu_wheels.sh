#!/usr/bin/env bash
# Wheels for vLLM's OpenAI server on the GPU machine (no network; vLLM 0.25 from ../shared/vllm-gpu): the
# packages `vllm serve` and vllm.entrypoints.openai.api_server import that neither the machine's image nor
# the vLLM bundle holds. verl's vLLM rollout runs that server in every replica, so scripts/verl_gpu_wheels.sh
# includes these; the `vllm serve` GPU tests need them too.
#
#   scripts/vllm_server_gpu_wheels.sh OUT_DIR    # then, there: pip install --no-index --no-deps OUT_DIR/*.whl
#
# Versions: vLLM 0.25's own pins (prometheus-fastapi-instrumentator>=8 needs starlette>=1, which the bundle
# has; model-hosting-container-standards<1.0 needs supervisor and jmespath). The rest of their needs
# (click, h11, anyio, fastapi, httpx, prometheus-client) are on the image or in the bundle.
set -euo pipefail
OUT=${1:?usage: scripts/vllm_server_gpu_wheels.sh OUT_DIR}
"$(dirname "$0")/gpu_wheels.sh" "$OUT" uvicorn==0.55.0 watchfiles==1.3.0 prometheus-fastapi-instrumentator==8.1.0 \
  model-hosting-container-standards==0.1.16 supervisor==4.3.0 jmespath==1.1.0
