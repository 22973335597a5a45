"""LoRA in the canonical forward: y = base(x) + scale · B(A(x)), with canonical ops on both sides.

The rule, the same for the trainer and every rollout engine, so an adapter's log-probs match bit for bit:

    h = linear(x, A)          # [tokens, r], bf16 (A's K order: the base layer's, row-parallel or not)
    d = linear(h, B) · scale  # bf16 product, then scaled and rounded to bf16
    y = add(base(x), d)       # bf16; a token no adapter claims keeps base(x) itself (kernels.lora_add)

Every op treats a token row on its own, so a token's numbers do not depend on which other tokens share
the batch or which adapters they use. Adapters come from one of two places:

- the module itself: a PEFT LoRA layer (`peft.inject_adapter_in_model`), its active adapters applied
  to every token (the trainer; any PEFT-wrapped model run through the canonical forward);
- the forward's `LoraRows` (the rollout engines): adapters held apart from the base model, each
  applied to the tokens whose requests named it, so one batch serves several adapters at once.

No PEFT import here: a PEFT layer is recognised by its `lora_A` / `lora_B` / `scaling` attributes.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

# (layer index, projection name) -> (A [r, in], B [out, r], scale); projection names are the Hugging Face
# module names (q_proj, k_proj, v_proj, o_proj, gate_proj, up_proj, down_proj)
LoraKey = tuple[int, str]
ROW_PARALLEL = ("o_proj", "down_proj")  # their A reads the base layer's K in its row-parallel order
# Projections that read one input (kernels.forward runs each group's base weights as one matmul, too). An
# adapter's A matrices of a group are row blocks of one tensor, so their shrink is one matmul: the same bits
# as one each, since an output element reduces its own row of A over K in the fixed order.
QKV = ("q_proj", "k_proj", "v_proj")
GATE_UP = ("gate_proj", "up_proj")


def per_member(op, base: torch.Tensor, h: torch.Tensor, b: torch.Tensor, widths: tuple[int, ...]) -> torch.Tensor:
    """op(base_j, h_j, b_j) for each member j of a projection group's terms laid side by side (kernels.lora_expand_add's
    `widths`: member j's columns of base and rows of B, its rank block of h), joined along the last dim."""
    r, outs, col = b.shape[-1], [], 0
    for j, w in enumerate(widths):
        outs.append(op(base[..., col:col + w], h[..., j * r:(j + 1) * r], b[col:col + w]))
        col += w
    return outs[0] if len(outs) == 1 else torch.cat(outs, dim=-1)


@dataclass(frozen=True)
class LoraWeights:
    """One adapter's tensors in the forward's terms (bf16, on the model's device).

    groups[(layer, names)] = (A of the group's projections as row blocks [sum r, in], their ranks), for a
    group (QKV, GATE_UP) whose projections all carry this adapter; group_b[(layer, names)] = their B as row
    blocks [sum out, r] where the ranks are equal (the group's expands then run as one op). The terms' A and B
    are views of these, so an in-place copy into a term's tensors (a CUDA graph's) reaches the group's too."""
    name: str
    terms: dict[LoraKey, tuple[torch.Tensor, torch.Tensor, float]]
    groups: dict[tuple[int, tuple[str, ...]], tuple[torch.Tensor, list[int]]] = field(
        init=False, repr=False, compare=False)
    group_b: dict[tuple[int, tuple[str, ...]], torch.Tensor] = field(init=False, repr=False, compare=False)

    def __post_init__(self):
        terms, groups, group_b = dict(self.terms), {}, {}
        for layer in sorted({layer for layer, _ in terms}):
            for names in (QKV, GATE_UP):
                parts = [terms.get((layer, n)) for n in names]
                if any(p is None for p in parts):
                    continue
                fused = torch.cat([a for a, _, _ in parts], dim=0)
                ranks = [a.shape[0] for a, _, _ in parts]
                bs = [b for _, b, _ in parts]
                if len(set(ranks)) == 1:
                    group_b[(layer, names)] = torch.cat(bs, dim=0)
                    bs = group_b[(layer, names)].split([b.shape[0] for b in bs], dim=0)
                row = 0
                for name, (a, _, scale), b, rank in zip(names, parts, bs, ranks):
                    terms[(layer, name)] = (fused[row:row + rank], b, scale)
                    row += rank
                groups[(layer, names)] = (fused, ranks)
        object.__setattr__(self, "terms", terms)
        object.__setattr__(self, "groups", groups)
        object.__setattr__(self, "group_b", group_b)

    def hold_a(self, layer: int, names: tuple[str, ...], rows: torch.Tensor) -> None:
        """Read the A of `names` in `layer` (a projection group, or one projection) from `rows` from now on: a
        tensor holding the same values (kernels.forward.fuse_projections: a row block of the base weight)."""
        if len(names) > 1:
            ranks = self.groups[(layer, names)][1]
            self.groups[(layer, names)] = (rows, ranks)
        else:
            ranks = [rows.shape[0]]
        row = 0
        for name, rank in zip(names, ranks):
            _, b, scale = self.terms[(layer, name)]
            self.terms[(layer, name)] = (rows[row:row + rank], b, scale)
            row += rank


@dataclass(frozen=True)
class LoraRows:
    """Which tokens of a forward use which adapter: (adapter, mask [B, T] bool or None = every token).
    Tokens no adapter claims run the base model."""
    adapters: tuple[tuple[LoraWeights, torch.Tensor | None], ...]


def lora_terms(rows: LoraRows | None, layer_idx: int, module: torch.nn.Module, name: str) -> list:
    """[(A, B, scale, mask or None)] for projection `name` of `module` in layer `layer_idx`."""
    if rows is not None:
        found = []
        for weights, mask in rows.adapters:
            term = weights.terms.get((layer_idx, name))
            if term is not None:
                found.append((*term, mask))
        return found
    return _peft_terms(getattr(module, name))


def _peft_terms(layer: torch.nn.Module) -> list:
    lora_a = getattr(layer, "lora_A", None)
    # PEFT's own switches: adapters disabled (disable_adapter(), e.g. a reference model's forward), or merged
    # into the base weights (merge_adapter()): the base alone then, as PEFT's forward does
    if lora_a is None or getattr(layer, "disable_adapters", False) or getattr(layer, "merged", False):
        return []
    terms = []
    for adapter in layer.active_adapters:
        if adapter not in lora_a:
            continue
        if not isinstance(layer.lora_dropout[adapter], torch.nn.Identity):
            raise ValueError(f"LoRA adapter {adapter!r} has lora_dropout > 0: dropout makes the trainer's "
                             f"forward differ from the rollout's; use lora_dropout=0")
        if getattr(layer, "use_dora", {}).get(adapter, False):
            raise ValueError(f"LoRA adapter {adapter!r} uses DoRA, which the canonical forward does not run")
        terms.append((lora_a[adapter].weight.to(torch.bfloat16), layer.lora_B[adapter].weight.to(torch.bfloat16),
                      float(layer.scaling[adapter]), None))
    return terms


def with_lora(ops, rows: LoraRows | None, layer_idx: int, module: torch.nn.Module, name: str,
              x: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """`out` (the base projection of `x`) plus each adapter's term on the tokens that use it."""
    for a, b, scale, mask in lora_terms(rows, layer_idx, module, name):
        out = _expand_add(ops, out, ops.linear(x, a, None, row_parallel=name in ROW_PARALLEL), b, scale, mask)
    return out


def _expand_add(ops, out: torch.Tensor, h: torch.Tensor, b: torch.Tensor, scale: float, mask) -> torch.Tensor:
    """out + the term of shrunk rows h through B: the expand, scale, add and select in one op where the op set
    has it (kernels.lora_expand_add: one launch on GPU), else the expand then kernels.lora_add; the same bits."""
    if ops.lora_expand_add is not None:
        return ops.lora_expand_add(out, h, b, scale, mask)
    return ops.lora_add(out, ops.linear(h, b, None), scale, mask)


def lora_projection(ctx, module: torch.nn.Module, name: str, x: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """`out`, the base projection `name` of x in a forward (kernels.forward.ForwardContext or RowChunkLora),
    plus its LoRA terms."""
    return with_lora(ctx.ops, ctx.lora_rows(), ctx.layer_idx, module, name, x, out)


def lora_projections(ctx, module: torch.nn.Module, names: tuple[str, ...], x: torch.Tensor,
                     outs: list[torch.Tensor], base: tuple[torch.Tensor, torch.Tensor] | None = None
                     ) -> list[torch.Tensor]:
    """lora_projection for projections that read the same `x` (QKV, GATE_UP; or one projection). An adapter held
    apart (LoraRows) that carries the whole group shrinks `x` once for all of them (LoraWeights.groups): fewer
    launches at prefill, the same bits. Each projection still takes its adapters' terms in their order.

    base: (product, weight) where the group's base product x @ weight.T ran over a weight that holds adapters'
    A matrices as extra row blocks (kernels.forward.fuse_projections): such an adapter's shrink is read from the
    product's columns, not computed again. Same bits: an output element reduces its own weight row over K in
    the fixed order, whatever other rows the weight holds."""
    rows = ctx.lora_rows()
    if rows is None:
        return [lora_projection(ctx, module, n, x, out) for n, out in zip(names, outs)]
    ops, layer, outs = ctx.ops, ctx.layer_idx, list(outs)
    for weights, mask in rows.adapters:
        group = weights.groups.get((layer, names))
        if group is not None:
            shrunk_all = _shrink(ops, x, group[0], base, False)
            group_b = weights.group_b.get((layer, names))
            joint = _joint_columns(outs) if group_b is not None and ops.lora_expand_add is not None else None
            if joint is not None:  # every expand of the group and its epilogue in one op
                widths = tuple(out.shape[-1] for out in outs)
                scale = weights.terms[(layer, names[0])][2]
                outs = list(ops.lora_expand_add(joint, shrunk_all, group_b, scale, mask, widths).split(widths, -1))
                continue
            shrunk = shrunk_all.split(group[1], dim=-1)
        for i, name in enumerate(names):
            term = weights.terms.get((layer, name))
            if term is None:
                continue
            a, b, scale = term
            h = shrunk[i] if group is not None else _shrink(ops, x, a, base, name in ROW_PARALLEL)
            outs[i] = _expand_add(ops, outs[i], h, b, scale, mask)
    return outs


def _joint_columns(outs: list[torch.Tensor]) -> torch.Tensor | None:
    """One view of `outs` side by side where they are consecutive column blocks of one tensor (a fused group's
    base product, or a group op's output), else None."""
    first, cols = outs[0], 0
    for out in outs:
        if (out.shape[:-1] != first.shape[:-1] or out.stride() != first.stride() or out.stride(-1) != 1
                or out.untyped_storage().data_ptr() != first.untyped_storage().data_ptr()
                or out.storage_offset() != first.storage_offset() + cols):
            return None
        cols += out.shape[-1]
    return first.as_strided((*first.shape[:-1], cols), first.stride(), first.storage_offset())


def _shrink(ops, x: torch.Tensor, a: torch.Tensor, base, row_parallel: bool) -> torch.Tensor:
    """linear(x, a): the base product's columns where `a` is a row block of its weight, else its own product."""
    if base is not None:
        product, weight = base
        first = row_block(a, weight)
        if first is not None:
            return product[..., first:first + a.shape[0]]
    return ops.linear(x, a, None, row_parallel=row_parallel)


def row_block(a: torch.Tensor, weight: torch.Tensor) -> int | None:
    """The index of `a`'s first row in `weight` where `a` is a view of whole consecutive rows of it, else None."""
    if (a.dim() != 2 or weight.dim() != 2 or a.shape[1] != weight.shape[1] or a.stride() != weight.stride()
            or a.untyped_storage().data_ptr() != weight.untyped_storage().data_ptr()):
        return None
    first, rest = divmod(a.storage_offset() - weight.storage_offset(), weight.stride(0))
    return first if rest == 0 and 0 <= first and first + a.shape[0] <= weight.shape[0] else None


class RowChunkLora:
    """A forward context's view for an MLP run in row chunks of its [B * T] tokens (kernels.forward,
    MLP_CHUNK_BYTES): the same ops and layer, the LoRA token masks cut to the chunk's rows (`rows`)."""

    def __init__(self, ctx):
        self.ctx, self.rows = ctx, slice(None)

    @property
    def ops(self):
        return self.ctx.ops

    @property
    def layer_idx(self) -> int:
        return self.ctx.layer_idx

    def lora_rows(self) -> LoraRows | None:
        lora = self.ctx.lora
        if lora is None:
            return None
        return LoraRows(tuple((w, None if m is None else m.reshape(-1)[self.rows]) for w, m in lora.adapters))
