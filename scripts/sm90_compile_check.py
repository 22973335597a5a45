"""Compile the Hopper Gluon matmuls (kernels/triton/matmul_sm90.py: tree_matmul_kernel, which also runs
the plain products, and swapped_matmul_kernel), or the LoRA expand kernel (kernels/triton/lora.py), for
sm_90a without a GPU, and report what ptxas made of them: registers, spills, the MMA warps' register
share, shared memory, and the HGMMAs against the wgmma waits. A kernel whose wgmma pipeline ptxas
serialised waits after every HGMMA instead of once per K tile. A register-pressure change can be
judged here before any GPU time is spent.

Needs the Triton the GPU machine runs (3.6: its Gluon API and its bundled ptxas and nvdisasm) and
torch (CPU is enough), e.g. in a venv of its own:

    pip install torch --index-url https://download.pytorch.org/whl/cpu && pip install triton==3.6.0
    python scripts/sm90_compile_check.py --m 4096 --n 4096 --k 4096 --segments 8 --tma-store
    python scripts/sm90_compile_check.py --kernel swapped --token-chunks 128,8 --block-n 64 --warps 4 \
        --stages 6 --segments 8 --split 2
    python scripts/sm90_compile_check.py --kernel swapped --weight-chunks 64,32 --block-m 128 --warps 4 \
        --stages 6 --segments 1
    SRC=my_variant.py python scripts/sm90_compile_check.py ...   # a modified copy of matmul_sm90.py
    python scripts/sm90_compile_check.py --kernel lora --m 256 --n 2048 --k 16 --block-m 64 --block-n 128 \
        --warps 4 --stages 2     # kernels/triton/lora.py's expand and epilogue (--k: the rank)

Prints one JSON object. Launch arguments as in matmul_sm90.launch / launch_swapped / launch_column_chunks;
extra constexprs a variant adds go in --constexpr NAME=INT, and --sass FILE keeps the disassembly.
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent


class _NoGpuDriver:
    """The parts of Triton's active driver that JIT warm-up reads, for an sm_90 target."""

    def __init__(self):
        from triton.backends.compiler import GPUTarget
        self.target = GPUTarget("cuda", 90, 32)

    def get_current_target(self):
        return self.target

    def get_current_device(self):
        return 0

    def get_current_stream(self, device=None):
        return 0

    def get_active_torch_device(self):
        return torch.device("cpu")


def _load_sm90(source: Path):
    """matmul_sm90 from `source`, outside the kernels.triton package (whose __init__ wants a GPU)."""
    sys.path.insert(0, str(ROOT))
    text = source.read_text().replace("from ..contract import", "from kernels.contract import")
    text = text.replace("from .device import num_sms", "num_sms = lambda index: 132  # an H100")
    path = Path(tempfile.mkdtemp()) / "matmul_sm90_check.py"
    path.write_text(text)
    spec = importlib.util.spec_from_file_location("matmul_sm90_check", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _load_triton_kernels(names: tuple[str, ...]):
    """Modules of kernels/triton/ (`names`, their imports among them) as a package of their own, outside
    kernels.triton (whose __init__ wants a GPU); returns the package's modules by name."""
    package = Path(tempfile.mkdtemp()) / "triton_kernels_check"
    package.mkdir()
    (package / "__init__.py").write_text("")
    for name in names:
        text = (ROOT / "kernels/triton" / f"{name}.py").read_text()
        (package / f"{name}.py").write_text(text.replace("from ..contract import", "from kernels.contract import"))
    sys.path.insert(0, str(ROOT))
    sys.path.insert(0, str(package.parent))
    return {name: importlib.import_module(f"triton_kernels_check.{name}") for name in names}


SHARED_BYTES = 232448  # an H100's shared memory per block


def _operands(m: int, n: int, k: int, split: int):
    """x [m, k], w [n, k] (bf16) and out: [m, n] bf16, or [split, m, n] fp32 subtrees."""
    out_shape, out_dtype = ((split, m, n), torch.float32) if split > 1 else ((m, n), torch.bfloat16)
    return (torch.empty(m, k, dtype=torch.bfloat16), torch.empty(n, k, dtype=torch.bfloat16),
            torch.empty(out_shape, dtype=out_dtype))


def _warm_tree_kernel(sm90, args):
    """tree_matmul_kernel compiled (not run) with launch()'s arguments."""
    m, n, split = args.m, args.n, args.split
    x, w, out = _operands(m, n, args.k, split)
    tma_store = args.tma_store and split == 1
    x_desc = sm90._operand_desc(x, args.block_m, args.segments)
    out_desc = sm90._tma_desc(out, args.block_m, args.block_n) if tma_store else x_desc
    return sm90.tree_matmul_kernel.warmup(
        x_desc, sm90._operand_desc(w, args.block_n, args.segments), out, out, out_desc, m, n,
        out.stride(0) if split > 1 else 0, out.stride(-2), NSEG=args.segments, SPLIT=split, HAS_BIAS=False,
        TMA_STORE=tma_store, BLOCK_M=args.block_m, BLOCK_N=args.block_n, GROUP_M=8, STAGES=args.stages,
        num_warps=args.warps, ROW_CHUNKS=args.row_chunks, maxnreg=sm90.mma_maxnreg(args.warps), grid=(1, ),
        **_constexprs(args))


def _warm_swapped_kernel(sm90, args):
    """swapped_matmul_kernel compiled (not run) with launch_swapped()'s arguments (--block-n weight rows,
    the batch's rows as --token-chunks HEAD,TAIL; --m is ignored: their sum) or, with --weight-chunks
    HEAD,TAIL, launch_column_chunks()'s (--block-m rows of x; --n is ignored: the chunks' sum)."""
    split = args.split
    if args.weight_chunks:
        head, tail = (int(v) for v in args.weight_chunks.split(","))
        m, n, block_a = args.block_m, head + tail, args.block_m
    else:
        head, tail = (int(v) for v in args.token_chunks.split(","))
        m, n, block_a = head + tail, args.n, args.block_n
    x, w, out = _operands(m, n, args.k, split)
    a, b = (x, w) if args.weight_chunks else (w, x)
    stages = sm90.swapped_stages(head, tail, block_a, args.stages, x.element_size(), SHARED_BYTES)
    return sm90.swapped_matmul_kernel.warmup(
        sm90._operand_desc(a, block_a, args.segments), sm90._operand_desc(b, head, args.segments),
        sm90._operand_desc(b, tail, args.segments), out, out, m, n, out.stride(0) if split > 1 else 0,
        out.stride(-2), NSEG=args.segments, SPLIT=split, HAS_BIAS=False, X_ON_A=bool(args.weight_chunks), GROUP_M=8,
        STAGES=stages, num_warps=args.warps, maxnreg=sm90.mma_maxnreg(args.warps), grid=(1, ), **_constexprs(args))


def _warm_lora_kernel(args):
    """kernels/triton/lora.py's _lora_expand_add_kernel compiled (not run) as lora_expand_add launches it:
    --m rows, --n columns in three members (q/k/v-like: half, then two quarters), rank --k, a token mask."""
    lora = _load_triton_kernels(("device", "elementwise", "matmul", "lora"))["lora"]
    m, n, r = args.m, args.n, args.k
    h, b = torch.empty(m, 3 * r, dtype=torch.bfloat16), torch.empty(n, r, dtype=torch.bfloat16)
    base, out = torch.empty(m, n, dtype=torch.bfloat16), torch.empty(m, n, dtype=torch.bfloat16)
    mask = torch.zeros(m, dtype=torch.bool)
    return lora._lora_expand_add_kernel.warmup(
        h, b, base, mask, out, m, n, n // 2, 3 * n // 4, r, 2.0, h.stride(0), h.stride(1), b.stride(0), b.stride(1),
        base.stride(0), out.stride(0), HAS_MASK=True, EVEN_K=r % lora.BLOCK_K == 0, BLOCK_M=args.block_m,
        BLOCK_N=args.block_n, BLOCK_K=lora.BLOCK_K, GROUP_M=8, num_warps=args.warps, num_stages=args.stages,
        grid=(1, ), **lora._NO_FMA)


def _constexprs(args) -> dict:
    return {name: int(value) for name, value in (kv.split("=") for kv in args.constexpr)}


def compile_kernel(args) -> dict:
    import triton
    from triton.runtime import driver
    driver.set_active(_NoGpuDriver())
    if args.kernel == "lora":
        kernel = _warm_lora_kernel(args)
    else:
        sm90 = _load_sm90(Path(os.environ.get("SRC", ROOT / "kernels/triton/matmul_sm90.py")))
        warm = _warm_swapped_kernel if args.kernel == "swapped" else _warm_tree_kernel
        kernel = warm(sm90, args)
    ptx = kernel.asm["ptx"]
    with tempfile.NamedTemporaryFile("w", suffix=".ptx", delete=False) as f:
        f.write(ptx)
    ptxas = Path(triton.__file__).parent / "backends/nvidia/bin/ptxas"
    run = subprocess.run([str(ptxas), "--gpu-name=sm_90a", "-v", f.name, "-o", os.devnull], capture_output=True,
                         text=True)
    log = run.stdout + run.stderr
    # the machine code: a wgmma pipeline that ptxas serialised waits after every HGMMA instead of once per
    # K tile (e.g. 19 waits for 60 HGMMAs in the tree kernel as it should be; one per HGMMA when serialised)
    cubin = Path(f.name).with_suffix(".cubin")
    subprocess.run([str(ptxas), "--gpu-name=sm_90a", f.name, "-o", str(cubin)], check=True)
    sass = subprocess.run([str(ptxas.parent / "nvdisasm"), "-c", str(cubin)], capture_output=True, text=True,
                          check=True).stdout
    if args.sass:
        Path(args.sass).write_text(sass)
    spills = [int(v) for v in re.findall(r"(\d+) bytes spill stores", log)]
    registers = [int(v) for v in re.findall(r"Used (\d+) registers", log)]
    return {
        "triton": triton.__version__,
        "launch": {key: value for key, value in vars(args).items() if key not in ("constexpr", "sass")}
        | {"constexprs": _constexprs(args)},
        "ptxas_ok": run.returncode == 0,
        "registers": registers[0] if registers else None,
        "spill_store_bytes": spills[0] if spills else None,
        "setmaxnreg": sorted({int(v) for v in re.findall(r"setmaxnreg\.\w+\.sync\.aligned\.u32\s+(\d+)", ptx)}),
        "shared_bytes": kernel.metadata.shared,
        "hgmma": sass.count("HGMMA."),
        "hmma": sass.count("HMMA."),  # mma.sync: Triton's dots in tiles of fewer than 64 rows
        "wgmma_waits": sass.count("WARPGROUP.DEPBAR"),
        "warnings": [line.strip() for line in log.splitlines() if "warning" in line.lower()],
    }


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--kernel", choices=("tree", "swapped", "lora"), default="tree",
                   help="tree_matmul_kernel (plain products too: --segments 1), swapped_matmul_kernel, or "
                        "kernels/triton/lora.py's expand and epilogue")
    p.add_argument("--token-chunks", default="128,8", help="swapped: the batch's rows as HEAD,TAIL")
    p.add_argument("--weight-chunks", help="swapped kernel with column chunks: a tile's weight rows as HEAD,TAIL")
    p.add_argument("--m", type=int, default=4096)
    p.add_argument("--n", type=int, default=4096)
    p.add_argument("--k", type=int, default=4096)
    p.add_argument("--block-m", type=int, default=128)
    p.add_argument("--block-n", type=int, default=128)
    p.add_argument("--warps", type=int, default=8)
    p.add_argument("--stages", type=int, default=5)
    p.add_argument("--segments", type=int, default=8, choices=(1, 2, 4, 8))
    p.add_argument("--split", type=int, default=1, choices=(1, 2, 4))
    p.add_argument("--row-chunks", type=int, default=1)
    p.add_argument("--tma-store", action="store_true")
    p.add_argument("--constexpr", action="append", default=[], metavar="NAME=INT",
                   help="an extra constexpr of a variant's tree_matmul_kernel")
    p.add_argument("--sass", metavar="FILE", help="also write the disassembled machine code there")
    print(json.dumps(compile_kernel(p.parse_args(argv)), indent=1))


if __name__ == "__main__":
    main()
