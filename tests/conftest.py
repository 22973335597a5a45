import os
import socket
import struct

import pytest
import torch

os.environ.setdefault("WANDB_MODE", "offline")
torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))


def bits(t: torch.Tensor) -> torch.Tensor:
    """Integer view of a tensor's bits, so comparisons are exact (-0.0 != 0.0, nan == nan)."""
    t = t.detach().contiguous()
    return t.view({torch.float32: torch.int32, torch.bfloat16: torch.int16}.get(t.dtype, t.dtype))


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and a.dtype == b.dtype and torch.equal(bits(a), bits(b))


def rollout_bits(rollout) -> tuple:
    """What must match bitwise between two rollouts: the finish reason, the tokens and every log-prob's
    exact bits (log-probs are float32 values held as Python floats)."""
    return (rollout.finish_reason, tuple(rollout.token_ids),
            tuple(struct.pack("<d", x) for x in rollout.logprobs))


def attention_fp32(q, k, v, positions, scale):
    """Causal GQA attention in fp32 einsums, query (b, t) seeing keys 0..positions[b, t]: the gradient oracle."""
    g = q.shape[2] // k.shape[2]
    kf, vf = k.float().repeat_interleave(g, dim=2), v.float().repeat_interleave(g, dim=2)
    scores = torch.einsum("bthd,blhd->bhtl", q.float(), kf) * scale
    keys = torch.arange(k.shape[1], device=q.device)
    visible = keys[None, None, None, :] <= positions.clamp_min(0)[:, None, :, None]
    probs = torch.softmax(scores.masked_fill(~visible, float("-inf")), dim=-1)
    return torch.einsum("bhtl,blhd->bthd", probs, vf)


def assert_bitwise_equal(a: torch.Tensor, b: torch.Tensor, what: str = ""):
    assert a.shape == b.shape, f"{what}: shapes {tuple(a.shape)} != {tuple(b.shape)}"
    assert a.dtype == b.dtype, f"{what}: dtypes {a.dtype} != {b.dtype}"
    eq = torch.equal(bits(a), bits(b))
    if not eq:
        diff = (a.float() - b.float()).abs()
        raise AssertionError(f"{what}: not bitwise equal; {int((bits(a) != bits(b)).sum())} elements differ, "
                             f"max |diff| {diff.max().item():.3e}")


@pytest.fixture
def tree_width():
    """kernels.set_tree_segments for one test; the process's width comes back after it."""
    import kernels as K
    before = K.tree_segments()
    yield K.set_tree_segments
    K.set_tree_segments(before)


@pytest.fixture(scope="session")
def device():
    return torch.device("cuda" if os.environ.get("ZEROKL_TEST_DEVICE") == "cuda" else "cpu")


@pytest.fixture(scope="module")
def gloo_group():
    """A one-rank gloo process group and its device mesh, for FSDP2 in this process; torn down after the
    module that asks for it."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    before = {k: os.environ.get(k) for k in ("MASTER_ADDR", "MASTER_PORT")}
    os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"] = "127.0.0.1", str(port)
    dist.init_process_group("gloo", rank=0, world_size=1)
    try:
        yield init_device_mesh("cpu", (1,))
    finally:
        dist.destroy_process_group()
        for key, value in before.items():  # later tests' subprocesses must not inherit this port
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


@pytest.fixture(scope="module")
def local_ray():
    """ray, initialised locally with 4 CPUs for the module's tests and shut down after them, unless Ray
    was already running."""
    ray = pytest.importorskip("ray")
    started = not ray.is_initialized()
    if started:
        ray.init(address="local", num_cpus=4, include_dashboard=False, log_to_driver=False)
    yield ray
    if started:
        ray.shutdown()


@pytest.fixture(scope="module")
def policy_checkpoints(tmp_path_factory):
    """Three tiny Qwen2 policies (seeds 0, 1, 2) saved as checkpoint directories, as a trainer saves them:
    the weight versions of the tests that switch weights under running requests."""
    from rollout_service.tiny_models import tiny_model
    paths = []
    for seed in (0, 1, 2):
        path = tmp_path_factory.mktemp(f"policy{seed}")
        tiny_model("qwen2", seed=seed).save_pretrained(path)
        paths.append(path)
    return paths
