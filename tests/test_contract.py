"""The canonical contract: one configuration, one check, and the block sizes it names are the ones
the kernels use."""
import pytest
import torch

import kernels as K
from kernels import contract
from kernels.reference import attention as reference_attention


def test_equal_contracts_pass_and_the_common_one_comes_back():
    cpu = K.canonical_config("cpu")
    assert K.check_canonical({"worker 0": cpu, "worker 1": K.canonical_config("cpu")}) == cpu
    assert cpu.kernels_version == K.__version__ and cpu.tree_segments == K.tree_segments()


def test_a_cpu_worker_and_a_gpu_trainer_are_refused():
    # CPU and GPU kernels are each invariant but round differently: the check must tell them apart
    worker, trainer = K.canonical_config("cpu"), K.canonical_config("cuda")
    assert worker != trainer
    with pytest.raises(K.CanonicalMismatchError, match=r"rollout workers: .* on cpu .*; trainer ranks: .* on cuda"):
        K.check_canonical({"rollout workers": worker, "trainer ranks": trainer})


def test_every_field_of_the_contract_is_checked():
    base = K.canonical_config("cpu")
    for field, other in (("kernels_version", "0.0.0"), ("kernel_family", "triton"), ("matmul_block_k", 64),
                         ("attention_block_kv", 64), ("attention_split_kv", 1024),
                         ("tree_segments", 4 if base.tree_segments != 4 else 2)):
        changed = contract.dataclasses.replace(base, **{field: other})
        with pytest.raises(K.CanonicalMismatchError, match="log-probs would differ"):
            K.check_canonical({"a": base, "b": changed})


def test_bad_reports_are_type_errors():
    with pytest.raises(TypeError, match="not a CanonicalConfig"):
        K.check_canonical({"a": K.canonical_config("cpu"), "b": {"tree_segments": 8}})
    with pytest.raises(ValueError, match="at least one"):
        K.check_canonical({})


def test_the_tree_width_setting_is_part_of_the_contract(tree_width):
    before = K.canonical_config("cpu")
    tree_width(4 if before.tree_segments != 4 else 2)
    with pytest.raises(K.CanonicalMismatchError):
        K.check_canonical({"before": before, "after": K.canonical_config("cpu")})


def test_attention_runs_with_the_contracts_block_size():
    """kernels.attention on CPU equals the reference at REFERENCE.attention_block_kv and
    attention_split_kv, and a different block or split size rounds differently: the contract's
    numbers are the ones in force."""
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 70, h, 16, generator=gen).to(torch.bfloat16) for h in (4, 2, 2))
    pos = torch.arange(70).unsqueeze(0)
    got = K.attention(q, k, v, pos)
    block = contract.REFERENCE.attention_block_kv
    split = contract.REFERENCE.attention_split_kv
    assert torch.equal(got, reference_attention(q, k, v, pos, block_kv=block, split_kv=split))
    assert not torch.equal(got, reference_attention(q, k, v, pos, block_kv=block // 2, split_kv=split))
    # the split too: rows within the first split agree, later ones round differently
    longer = reference_attention(q, k, v, pos, block_kv=block, split_kv=2 * split)
    assert torch.equal(got[:, :split], longer[:, :split]) and not torch.equal(got[:, split:], longer[:, split:])

