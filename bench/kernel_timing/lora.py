"""A decode step's LoRA ops one by one (kernels.lora's rule at Qwen2.5-1.5B shapes) against cuBLAS doing the same
products, per layer: where the canonical LoRA's extra time goes, and what fusing each shrink into its base
product (the adapter's A rows appended to the base weight: one product, the same bits per output element,
since an element reduces its own weight row over K in the fixed order) and each expand with its epilogue in one
launch (kernels.lora_expand_add; a group's in one launch) save."""
from __future__ import annotations

import torch

import kernels
import kernels.triton as kt
from bench.kernel_timing.timing import bench_ms

HIDDEN, INTER, Q_OUT, KV_OUT = 1536, 8960, 1536, 256  # Qwen2.5-1.5B: 12 heads (2 KV heads) of 128
# (group, K, base rows, the group's projections' output widths, segments of the base product: o and down are
# row-parallel, 8-segment trees)
GROUPS = [("qkv", HIDDEN, Q_OUT + 2 * KV_OUT, (Q_OUT, KV_OUT, KV_OUT), 1), ("o", HIDDEN, HIDDEN, (HIDDEN,), 8),
          ("gate_up", HIDDEN, 2 * INTER, (INTER, INTER), 1), ("down", INTER, HIDDEN, (HIDDEN,), 8)]


def run_lora_ops(rep: int, ms=(64, 256), rank: int = 16) -> list[dict]:
    """Per M and projection group: ms for the base product, the shrink, the expands and the epilogues
    (canonical), the same products in cuBLAS, and the base product with the shrink's rows appended."""
    gen = torch.Generator(device="cuda").manual_seed(0)

    def rand(*shape):
        return (torch.randn(*shape, generator=gen, device="cuda") * 0.02).to(torch.bfloat16)

    rows = []
    for m in ms:
        for name, k, n_base, outs, segments in GROUPS:
            x, w, a = rand(m, k), rand(n_base, k), rand(rank * len(outs), k)
            b_group = rand(sum(outs), rank)  # the group's B as row blocks of one tensor, as held adapters keep them
            bs = list(b_group.split(list(outs)))
            h = rand(m, rank * len(outs))
            base_group = rand(m, sum(outs))
            base_outs = list(base_group.split(list(outs), dim=-1))
            wa = torch.cat([w, a])
            row = {"m": m, "group": name, "k": k, "base_n": n_base, "rank": rank, "segments": segments,
                   "base_ms": bench_ms(lambda: kt.matmul(x, w, None, segments=segments), rep),
                   "shrink_ms": bench_ms(lambda: kt.matmul(x, a, None, segments=segments), rep),
                   # the shrink as an 8-segment tree (other bits where the base product is plain: a rule change)
                   "shrink_tree8_ms": bench_ms(lambda: kt.matmul(x, a, None, segments=8), rep),
                   "base_with_shrink_rows_ms": bench_ms(lambda: kt.matmul(x, wa, None, segments=segments), rep),
                   "expand_ms": sum(bench_ms(lambda b=b, i=i: kt.matmul(h[:, i * rank:(i + 1) * rank], b), rep)
                                    for i, b in enumerate(bs)),
                   "epilogue_ms": sum(bench_ms(lambda o=o: kernels.lora_add(o, o, 2.0), rep) for o in base_outs),
                   # each expand and its epilogue in one launch (kernels.lora_expand_add, the same bits)
                   "expand_epilogue_fused_ms": sum(
                       bench_ms(lambda b=b, i=i, o=o: kt.lora_expand_add(o, h[:, i * rank:(i + 1) * rank], b, 2.0,
                                                                        None), rep)
                       for i, (b, o) in enumerate(zip(bs, base_outs))),
                   # the group's expands and epilogues in one launch (what the plugin runs at decode)
                   "expand_epilogue_group_ms": bench_ms(
                       lambda: kt.lora_expand_add(base_group, h, b_group, 2.0, None, tuple(outs)), rep),
                   "cublas_shrink_ms": bench_ms(lambda: x @ a.T, rep),
                   "cublas_expand_ms": sum(bench_ms(lambda b=b, i=i: h[:, i * rank:(i + 1) * rank] @ b.T, rep)
                                           for i, b in enumerate(bs))}
            row["lora_ms"] = row["shrink_ms"] + row["expand_ms"] + row["epilogue_ms"]
            row["cublas_lora_ms"] = row["cublas_shrink_ms"] + row["cublas_expand_ms"]
            row["shrink_fused_saves_ms"] = row["base_ms"] + row["shrink_ms"] - row["base_with_shrink_rows_ms"]
            row["expand_fused_saves_ms"] = row["expand_ms"] + row["epilogue_ms"] - row["expand_epilogue_group_ms"]
            rows.append({key: round(v, 5) if isinstance(v, float) else v for key, v in row.items()})
    for m in ms:
        layer = [r for r in rows if r["m"] == m]
        rows.append({"m": m, "group": "layer", **{key: round(sum(r[key] for r in layer), 5) for key in (
            "lora_ms", "shrink_ms", "expand_ms", "epilogue_ms", "expand_epilogue_fused_ms", "expand_epilogue_group_ms",
            "cublas_lora_ms", "shrink_fused_saves_ms", "expand_fused_saves_ms")}})
    return rows
