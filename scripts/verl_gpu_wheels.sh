#!/usr/bin/env bash
# Wheels for verl's GSM8K GRPO test on a GPU machine without network (Python 3.12, torch 2.11, vLLM 0.25 and
# transformers already there): verl 0.9.1 and the dependencies its trainer imports that such a machine lacks,
# with vLLM's OpenAI server's (scripts/vllm_server_gpu_wheels.sh: verl's rollout replicas run that server).
#
#   scripts/verl_gpu_wheels.sh OUT_DIR        # then, there: pip install --no-index --no-deps OUT_DIR/*.whl
#
# --no-deps there as here: verl pins transformers (>=5.5.3,<5.11) and the machine's own stays in place.
# omegaconf 2.3 (hydra-core 1.3's range) needs antlr4-python3-runtime 4.9, published as a source archive
# only: it and pylatexenc are built into wheels here (both pure Python).
set -euo pipefail
OUT=${1:?usage: scripts/verl_gpu_wheels.sh OUT_DIR}
HERE=$(dirname "$0")
"$HERE/gpu_wheels.sh" "$OUT" verl==0.9.1 tensordict==0.10.0 pyvers==0.1.0 hydra-core==1.3.8 omegaconf==2.3.1 \
  codetiming==1.4.0 torchdata==0.11.0 pybind11 dill peft==0.21.2 accelerate transferqueue==0.1.11 prometheus_client \
  orjson
"$HERE/vllm_server_gpu_wheels.sh" "$OUT"
"${PYTHON:-python}" -m pip wheel -q --no-deps -w "$OUT" antlr4-python3-runtime==4.9.3 pylatexenc==2.11
ls "$OUT"
