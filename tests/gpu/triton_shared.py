"""What the Triton kernel tests share: the device they run on and the kernels package.

TRITON_INTERPRET=1 runs the kernels on CPU tensors through Triton's interpreter (the small cases only);
otherwise they need CUDA."""
from __future__ import annotations

import os

import pytest
import torch

INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"
DEV = "cpu" if INTERPRET else "cuda"
needs_cuda = pytest.mark.skipif(INTERPRET, reason="needs a real GPU (cuBLAS, model-sized shapes)")


@pytest.fixture(scope="module")
def kt():
    """kernels.triton, or a skip where there is no CUDA device and no interpreter."""
    if not INTERPRET and not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    return pytest.importorskip("kernels.triton")
