"""The canonical forward of a Llama / Qwen2 / Qwen3 decoder, written once over an op set.

The trainer (trainer_patch) and the rollout verifier run it with CANONICAL_OPS; the native fast path
runs the very same code with ordinary torch ops. Weights are read from the Hugging Face modules
(under FSDP2, from their unsharded parameters), so there is one copy of the model.
"""
from __future__ import annotations

import os
from dataclasses import dataclass, field

import torch

import kernels as K
from kernels.backward import mark_whole_sequences
from kernels.lora import GATE_UP, QKV, LoraRows, LoraWeights, RowChunkLora, lora_projections
from kernels.moe import MoESpec, is_moe_block, moe_forward, moe_spec
from kernels.opset import CANONICAL_OPS, OpSet
from kernels.packed_attention import PackedRow
from kernels.rope import RopeTable

SUPPORTED_ARCHITECTURES = ("LlamaForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM", "Qwen3MoeForCausalLM")


@dataclass(frozen=True)
class ModelSpec:
    architecture: str
    num_layers: int
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    rms_norm_eps: float
    qk_norm: bool
    max_positions: int
    moe: MoESpec | None = None  # sparse MLP layers (Qwen3-MoE)


def model_spec(model: torch.nn.Module) -> ModelSpec:
    """Validate that `model` is a supported dense decoder and describe it."""
    arch = type(model).__name__
    # FSDP2 wraps the class in a dynamic subclass; look through it.
    for cls in type(model).__mro__:
        if cls.__name__ in SUPPORTED_ARCHITECTURES:
            arch = cls.__name__
            break
    else:
        raise TypeError(f"unsupported model {arch}: supported are {', '.join(SUPPORTED_ARCHITECTURES)}")
    cfg = model.config
    if getattr(cfg, "use_sliding_window", False):
        raise ValueError("sliding-window attention is not supported (use_sliding_window=True)")
    if getattr(cfg, "hidden_act", "silu") != "silu":
        raise ValueError(f"only SiLU MLPs are supported, got hidden_act={cfg.hidden_act!r}")
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    return ModelSpec(arch, cfg.num_hidden_layers, cfg.hidden_size, cfg.num_attention_heads,
                     cfg.num_key_value_heads, head_dim, cfg.vocab_size, cfg.rms_norm_eps,
                     arch in ("Qwen3ForCausalLM", "Qwen3MoeForCausalLM"), cfg.max_position_embeddings,
                     moe_spec(cfg) if arch == "Qwen3MoeForCausalLM" else None)


def rope_table(model: torch.nn.Module) -> RopeTable:
    """The model's rotary table, from its config alone (kernels.rope; never a module's inv_freq buffer)."""
    table = model.__dict__.get("_zerokl_rope")
    if table is None:
        table = RopeTable.from_config(model.config)
        head_dim = model_spec(model).head_dim
        if table.spec.rotary_dim != head_dim:  # the forward rotates whole heads
            raise ValueError(f"partial rotary embeddings are not supported: rotary dim {table.spec.rotary_dim} "
                             f"!= head_dim {head_dim}")
        model.__dict__["_zerokl_rope"] = table
    return table


@dataclass
class PagedKV:
    """A paged KV cache: per layer [num_blocks, block_size, Hkv, D] pools, written at slot_mapping."""
    k_pools: list[torch.Tensor]
    v_pools: list[torch.Tensor]
    block_table: torch.Tensor  # [B, max_blocks] int
    slot_mapping: torch.Tensor  # [B, T] flat slot per token (padding tokens: a scratch slot nobody reads)
    _cache_index: tuple | None = field(default=None, init=False, repr=False)

    def attend(self, ops: OpSet, layer_idx: int, q, k, v, positions, scale: float) -> torch.Tensor:
        """Writes this step's K/V at slot_mapping, then attends over the cache."""
        # fixed shapes, no host sync: a forward over this cache can be captured in a CUDA graph
        kp, vp = self.k_pools[layer_idx], self.v_pools[layer_idx]
        if self._cache_index is None:  # (block, offset) per token, shared by every layer
            slots = self.slot_mapping.reshape(-1)
            self._cache_index = (slots // kp.shape[1], slots % kp.shape[1])
        K.write_kv(kp, vp, *self._cache_index, k.reshape(-1, *k.shape[2:]), v.reshape(-1, *v.shape[2:]))
        return ops.attention(q, kp, vp, positions, self.block_table, scale)


class ForwardContext:
    """What every layer of one forward shares. A plain class on purpose, not a dataclass: FSDP2's
    MixedPrecisionPolicy(cast_forward_inputs=True), its default, casts the floating tensors it finds
    in a layer's arguments (inside dataclasses, dicts, tuples) to bf16, and the float32 rotary rows
    must reach the layers as they are."""
    __slots__ = ("ops", "spec", "positions", "cos", "sin", "kv", "routing", "sequence_lengths",
                 "packed_row", "sequence_positions", "defer_residual", "pending", "lora",
                 "layer_idx")

    def __init__(self, ops: OpSet, spec: ModelSpec, positions: torch.Tensor, cos: torch.Tensor,
                 sin: torch.Tensor, kv: PagedKV | None = None, routing: list | None = None,
                 sequence_lengths: tuple[int, ...] | None = None, lora: LoraRows | None = None):
        self.ops, self.spec = ops, spec
        self.lora = lora  # adapters held apart from the model, by token (kernels.lora); None: the modules' own
        self.layer_idx = 0  # the layer running now (LoRA terms are keyed by it)
        self.positions = positions  # [B, T]; negative = padding token
        self.cos, self.sin = cos, sin  # float32 rotary rows per token
        self.kv = kv  # None: contiguous KV of this call (training / full sequences)
        self.routing = routing  # a list: each MoE layer appends its expert ids [B, T, k]
        self.sequence_lengths = sequence_lengths  # a packed row [1, N]: its sequences' lengths (kernels.packed_attention.packed_lengths)
        self.packed_row = None if sequence_lengths is None else PackedRow.of(sequence_lengths, positions)
        # an op set without the one-launch packed attention attends per sequence: each sequence's
        # positions, one tensor for every layer, known to run 0..L-1 (packed_lengths checked them), so
        # the attention backward asks the host nothing about them
        self.sequence_positions = None if sequence_lengths is None or ops.attention_sequences is not None else [
            mark_whole_sequences(p) for p in positions.split(list(sequence_lengths), dim=1)]
        # Without autograd a layer's last residual add is left to the next norm (one fused launch,
        # the same bits). With it, every layer adds its own: FSDP2 prepares a layer's backward from
        # the tensors that layer returns.
        self.defer_residual = not torch.is_grad_enabled()
        self.pending: torch.Tensor | None = None  # the previous layer's deferred residual term

    def lora_rows(self) -> LoraRows | None:
        return self.lora

    def add_norm(self, hidden: torch.Tensor, weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(hidden + the deferred term, if any; rms_norm of that)."""
        pending, self.pending = self.pending, None
        if pending is None:
            return hidden, self.ops.rms_norm(hidden, weight, self.spec.rms_norm_eps)
        return self.ops.add_rms_norm(hidden, pending, weight, self.spec.rms_norm_eps)

    def residual(self, hidden: torch.Tensor, delta: torch.Tensor) -> torch.Tensor:
        """hidden + delta at a layer's end, or hidden with delta deferred to the next add_norm."""
        if self.defer_residual:
            self.pending = delta
            return hidden
        return self.ops.add(hidden, delta)


def _bf16(t: torch.Tensor | None) -> torch.Tensor | None:
    return None if t is None else t.to(torch.bfloat16)


# Without autograd, a step's MLP runs in row chunks once its gate/up output would pass MLP_CHUNK_BYTES:
# its [tokens, intermediate] tensors are a prefill step's largest, and vLLM leaves the peak of its
# profiling step out of the KV cache. Below the budget the MLP runs whole, as stock vLLM's does (Qwen2.5-1.5B
# up to 29,959 rows, Llama-3.1-8B up to 18,724: vLLM's 16,384-token prefill steps run whole; measured on an
# H200, whole MLPs took the plugin's LoRA prefill from 1.15 to 0.94 s, stock's 1.00 s: fewer chunks launch fewer
# kernels, an adapter's among them). Every MLP op treats rows on their own, so the bits do not change. ZEROKL_MLP_CHUNK_ROWS (read at import) fixes the rows per chunk instead.
MLP_CHUNK_BYTES = 1 << 30
MLP_CHUNK_ROWS_ENV = "ZEROKL_MLP_CHUNK_ROWS"


def _mlp_chunk_rows() -> int | None:
    raw = os.environ.get(MLP_CHUNK_ROWS_ENV)
    if raw is None:
        return None
    if not raw.isdigit() or int(raw) < 1:
        raise ValueError(f"{MLP_CHUNK_ROWS_ENV}={raw!r}: expected a positive number of rows")
    return int(raw)


MLP_CHUNK_ROWS = _mlp_chunk_rows()  # None: rows from MLP_CHUNK_BYTES


def mlp_chunk_rows(intermediate: int) -> int:
    """Rows per MLP chunk for an MLP of this (local) intermediate size: ZEROKL_MLP_CHUNK_ROWS where set, else
    the most rows whose gate/up output ([rows, 2 * intermediate] bf16) fits MLP_CHUNK_BYTES."""
    if MLP_CHUNK_ROWS is not None:
        return MLP_CHUNK_ROWS
    return max(1, MLP_CHUNK_BYTES // (4 * intermediate))


def decoder_layer_forward(layer: torch.nn.Module, hidden: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
    """One decoder layer; installed as the layer's forward so FSDP2's hooks still wrap it."""
    ops, spec = ctx.ops, ctx.spec
    attn, mlp = layer.self_attn, layer.mlp
    ctx.layer_idx = attn.layer_idx
    b, t, _ = hidden.shape
    hidden, x = ctx.add_norm(hidden, _bf16(layer.input_layernorm.weight))
    q, k, v = (p.view(b, t, -1, spec.head_dim) for p in _projections(ops, x, attn, QKV, ctx))
    del x
    if spec.qk_norm:
        q = ops.rms_norm(q, _bf16(attn.q_norm.weight), spec.rms_norm_eps)
        k = ops.rms_norm(k, _bf16(attn.k_norm.weight), spec.rms_norm_eps)
    q, k = ops.rotary_qk(q, k, ctx.cos, ctx.sin)
    scale = getattr(attn, "scaling", spec.head_dim ** -0.5)
    if ctx.kv is None:
        o = _contiguous_attention(ops, q, k, v, ctx, scale)
    else:  # the cache picks the query layout (each query row's numbers do not depend on it)
        o = ctx.kv.attend(ops, attn.layer_idx, q, k, v, ctx.positions, scale)
    # Each intermediate is dropped once used: a prefill step's peak memory is what vLLM leaves out of
    # its KV cache (autograd keeps what backward needs either way).
    del q, k, v
    o = o.reshape(b, t, -1)
    o = _projections(ops, o, attn, O_PROJ, ctx)[0]
    hidden, x = ops.add_rms_norm(hidden, o, _bf16(layer.post_attention_layernorm.weight), spec.rms_norm_eps)
    del o
    if spec.moe is not None and is_moe_block(mlp):
        return ctx.residual(hidden, moe_forward(mlp, x, spec.moe, ops, _bf16, ctx.routing))
    chunk = mlp_chunk_rows(mlp.down_proj.weight.shape[-1])
    if torch.is_grad_enabled() or b * t <= chunk:  # autograd keeps every chunk's tensors anyway
        return ctx.residual(hidden, _dense_mlp(ops, mlp, x, ctx))
    rows = x.reshape(b * t, -1)
    del x
    down = torch.empty_like(rows)
    chunk_ctx = RowChunkLora(ctx)
    for lo in range(0, b * t, chunk):
        chunk_ctx.rows = slice(lo, lo + chunk)
        down[lo:lo + chunk] = _dense_mlp(ops, mlp, rows[lo:lo + chunk], chunk_ctx)
    return ctx.residual(hidden, down.view(b, t, -1))


def _contiguous_attention(ops: OpSet, q, k, v, ctx: ForwardContext, scale: float) -> torch.Tensor:
    """Attention over this call's own K/V. A packed row's sequences each attend alone: every query row
    gets the numbers it gets with its sequence scored on its own ([1, L], positions 0..L-1), so packing
    cannot change a bit of it, and no query row ever sees another sequence's keys or a pad."""
    if ctx.sequence_lengths is None:
        return ops.attention(q, k, v, ctx.positions, None, scale)
    if ops.attention_sequences is not None:
        return ops.attention_sequences(q, k, v, ctx.packed_row, scale)
    parts, start = [], 0
    for length, positions in zip(ctx.sequence_lengths, ctx.sequence_positions):
        rows = slice(start, start + length)
        parts.append(ops.attention(q[:, rows], k[:, rows], v[:, rows], positions, None, scale))
        start += length
    return torch.cat(parts, dim=1)


def _dense_mlp(ops: OpSet, mlp: torch.nn.Module, x: torch.Tensor, ctx) -> torch.Tensor:
    """down_proj(silu(gate_proj(x)) * up_proj(x)), each intermediate dropped once used."""
    gate, up = _projections(ops, x, mlp, GATE_UP, ctx)
    act = ops.silu_mul(gate, up)
    del gate, up
    return _projections(ops, act, mlp, DOWN_PROJ, ctx)[0]


# A projection group's base product: the projections that read the same input (kernels.lora's QKV, GATE_UP)
# run as one canonical matmul where fuse_projections has put their weights in one tensor; o and down, whose
# K is the row-parallel one, are groups of one. Same bits as one matmul each: an output element reduces its
# own weight row over K in the fixed order, whatever the other rows are. The same holds for adapters' A rows
# appended to a group's tensor (fuse_projections' `adapters`): their shrink comes out of the base product.
O_PROJ, DOWN_PROJ = ("o_proj",), ("down_proj",)
ROW_PARALLEL_GROUPS = (O_PROJ, DOWN_PROJ)
_FUSED = "_zerokl_fused"  # module.__dict__ entry: {group names: FusedGroup}


@dataclass(frozen=True)
class FusedGroup:
    weight: torch.Tensor  # the projections' weights as row blocks, then any adapters' A blocks
    bias: torch.Tensor | None  # the projections' biases, zeros for the A blocks
    rows: list[int]  # each projection's rows (the A blocks follow their sum)


def _projections(ops: OpSet, x: torch.Tensor, module: torch.nn.Module, names: tuple[str, ...],
                 ctx) -> list[torch.Tensor]:
    """The base projections `names` of x with their LoRA terms."""
    row_parallel = names in ROW_PARALLEL_GROUPS
    fused = module.__dict__.get(_FUSED, {}).get(names)
    if fused is None:
        outs = [ops.linear(x, _bf16(getattr(module, n).weight), _bf16(getattr(module, n).bias),
                           row_parallel=row_parallel) for n in names]
        return lora_projections(ctx, module, names, x, outs)
    product = ops.linear(x, fused.weight, fused.bias, row_parallel=row_parallel)
    base_rows = sum(fused.rows)
    outs = product[..., :base_rows].split(fused.rows, dim=-1)
    held = (product, fused.weight) if base_rows < fused.weight.shape[0] else None
    outs = lora_projections(ctx, module, names, x, outs, base=held)
    # o and down feed the residual add: a column view of the product (no adapter term on it) is copied out
    return [out.contiguous() for out in outs] if len(names) == 1 else outs


def fuse_projections(model: torch.nn.Module, adapters: tuple[LoraWeights, ...] = ()) -> None:
    """For an inference copy (the vLLM plugin's model): each layer's q/k/v_proj, and the dense MLP's
    gate/up_proj, get parameters that are row blocks of one tensor per group (values kept), so the
    forward runs one matmul per group. With `adapters` (fixed tensors, filled in place later), each
    adapter's A matrices of a group become row blocks after the group's weights, o_proj and down_proj
    become groups too where an adapter targets them, and every shrink is a part of its base product.
    Called again, it rebuilds the groups for the adapters given: an adapter held before keeps its values
    but its own tensors, and its shrinks run on their own. Loads into these parameters in place keep the
    fusion; the trainer's model is never fused (FSDP2 shards its parameters one by one)."""
    for layer in model.model.layers:
        index = layer.self_attn.layer_idx
        for module, names in ((layer.self_attn, QKV), (layer.self_attn, O_PROJ), (layer.mlp, GATE_UP),
                              (layer.mlp, DOWN_PROJ)):
            parts = [getattr(module, n, None) for n in names]
            if any(p is None for p in parts) or len({p.bias is None for p in parts}) > 1:
                continue  # an MoE block, or biases on some projections only
            blocks = [block for w in adapters for block in _a_blocks(w, index, names)]
            if len(names) == 1 and not blocks:
                continue  # a group of one without adapters: nothing to fuse
            _fuse_group(module, index, names, parts, blocks)


def _a_blocks(adapter: LoraWeights, layer: int, names: tuple[str, ...]) -> list:
    """[(adapter, names it covers, A rows)]: the adapter's A of the whole group where it carries every
    projection of it (LoraWeights.groups), else one block per projection it carries."""
    group = adapter.groups.get((layer, names)) if len(names) > 1 else None
    if group is not None:
        return [(adapter, names, group[0])]
    return [(adapter, (n,), adapter.terms[(layer, n)][0]) for n in names if (layer, n) in adapter.terms]


def _fuse_group(module: torch.nn.Module, layer: int, names: tuple[str, ...], parts: list[torch.nn.Module],
                blocks: list) -> None:
    """One tensor for the group: its projections' weights (each parameter re-pointed to its block, requires_grad
    off: an inference copy), then each adapter's A (its tensors re-pointed to their block)."""
    rows = [p.weight.shape[0] for p in parts]
    weights = [p.weight.detach() for p in parts] + [a for _, _, a in blocks]
    fused = torch.cat(weights, dim=0)
    bias = None
    if parts[0].bias is not None:
        extra = sum(a.shape[0] for _, _, a in blocks)
        bias = torch.cat([p.bias.detach() for p in parts] + [parts[0].bias.new_zeros(extra)])
    row = 0
    for i, part in enumerate(parts):
        part.weight = torch.nn.Parameter(fused[row:row + rows[i]], requires_grad=False)
        if bias is not None:
            part.bias = torch.nn.Parameter(bias[row:row + rows[i]], requires_grad=False)
        row += rows[i]
    for adapter, covers, a in blocks:
        adapter.hold_a(layer, covers, fused[row:row + a.shape[0]])
        row += a.shape[0]
    module.__dict__.setdefault(_FUSED, {})[names] = FusedGroup(fused, bias, rows)


def forward_hidden(model: torch.nn.Module, input_ids: torch.Tensor, positions: torch.Tensor, *,
                   ops: OpSet = CANONICAL_OPS, kv: PagedKV | None = None, routing: list | None = None,
                   sequence_lengths: tuple[int, ...] | None = None, lora: LoraRows | None = None) -> torch.Tensor:
    """Final-norm hidden states [B, T, H] (bf16) for token ids [B, T] at absolute positions [B, T].
    lora: adapters by token (kernels.lora.LoraRows); None: whatever LoRA layers the modules carry (PEFT).
    routing: a list that receives each MoE layer's expert ids [B, T, k] (MoE models).
    sequence_lengths: a packed row [1, N] of sequences of these lengths (packed_lengths(positions)),
    each scored as if alone; contiguous KV only."""
    spec = model_spec(model)
    if sequence_lengths is not None and (kv is not None or input_ids.shape[0] != 1
                                         or sum(sequence_lengths) != input_ids.shape[1]):
        raise ValueError(f"sequence_lengths {sequence_lengths} must split one contiguous row [1, N]; got "
                         f"input_ids {tuple(input_ids.shape)}{' with a paged cache' if kv is not None else ''}")
    cos, sin = rope_table(model).lookup(positions)
    ctx = ForwardContext(ops, spec, positions, cos, sin, kv, routing, sequence_lengths, lora)
    hidden = model.model.embed_tokens(input_ids).to(torch.bfloat16)
    for layer in model.model.layers:
        hidden = layer(hidden, ctx) if _is_patched(layer) else decoder_layer_forward(layer, hidden, ctx)
    return ctx.add_norm(hidden, _bf16(model.model.norm.weight))[1]


def compute_logits(model: torch.nn.Module, hidden: torch.Tensor, ops: OpSet = CANONICAL_OPS) -> torch.Tensor:
    """float32 logits from final hidden states (fp32 accumulator, never rounded to bf16)."""
    return ops.logits(hidden, lm_head_weight(model))


def lm_head_weight(model: torch.nn.Module) -> torch.Tensor:
    """The lm head's weight [V, H] as the canonical logits read it (bf16)."""
    return _bf16(model.lm_head.weight)


def _is_patched(layer: torch.nn.Module) -> bool:
    return layer.__dict__.get("_zerokl_patched", False)
