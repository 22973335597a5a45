"""Rollout throughput of `off`, `verified` and `invariant` in one run, same model and workload.

`verified` runs under the engine's default decode policy (auto: DVR or canonical steps, whichever it
measures faster); `verified-dvr` forces propose-and-verify on every step.
Prints JSON: generated tokens/s per mode and batch size, the verified/off, verified/invariant and
dvr/off ratios, rollbacks per request, the fraction of proposed tokens that were recomputed, verify
windows per request and the auto policy's measured rates.
Models have random weights (shapes are what matter): tiny, qwen1.5b (Qwen2.5-1.5B shapes) or llama8b
(Llama-3.1-8B shapes).
"""
from __future__ import annotations

import argparse
import json
import random
import time

import torch
import transformers

import kernels as K
from rollout_service import Engine, SamplingParams
from rollout_service.engine.decode_policy import DecodePolicy
from rollout_service.tiny_models import tiny_config
from bench import emit

SHAPES = {
    "tiny": dict(arch="qwen2", hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4, num_kv_heads=2,
                 vocab_size=96),
    "qwen0.5b": dict(arch="qwen2", hidden_size=896, intermediate_size=4864, num_layers=24, num_heads=14,
                     num_kv_heads=2, vocab_size=151936),
    "qwen1.5b": dict(arch="qwen2", hidden_size=1536, intermediate_size=8960, num_layers=28, num_heads=12,
                     num_kv_heads=2, vocab_size=151936),
    "qwen3-4b": dict(arch="qwen3", hidden_size=2560, intermediate_size=9728, num_layers=36, num_heads=32,
                     num_kv_heads=8, head_dim=128, vocab_size=151936, tie_word_embeddings=True),
    # Qwen3-30B-A3B (48 layers: pass num_layers to fit the GPU); stock vLLM MoE is not in the GPU bundle
    "qwen3moe30b": dict(arch="qwen3_moe", hidden_size=2048, intermediate_size=6144, num_layers=48, num_heads=32,
                        num_kv_heads=4, head_dim=128, vocab_size=151936, num_experts=128, num_experts_per_tok=8,
                        moe_intermediate_size=768),
    "llama8b": dict(arch="llama", hidden_size=4096, intermediate_size=14336, num_layers=32, num_heads=32,
                    num_kv_heads=8, vocab_size=128256),
}


def build_model(name: str, device: str, num_layers: int | None = None):
    """A randomly initialised bf16 model of shape `name` (num_layers: fewer layers, same layer shape)."""
    shape = dict(SHAPES[name])
    arch = shape.pop("arch")
    if num_layers:
        shape["num_layers"] = num_layers
    cfg = tiny_config(arch, max_positions=32768, **shape)  # room for 1,024 in + 8,192 out
    cls = {"llama": transformers.LlamaForCausalLM, "qwen2": transformers.Qwen2ForCausalLM,
           "qwen3": transformers.Qwen3ForCausalLM, "qwen3_moe": transformers.Qwen3MoeForCausalLM}[arch]
    torch.manual_seed(0)
    default = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        with torch.device(device):
            model = cls(cfg)
    finally:
        torch.set_default_dtype(default)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() >= 2:  # matrices and stacked expert weights
                p.normal_(0.0, 0.02)
    return model.eval()


def save_model(name: str, path: str, num_layers: int | None = None) -> None:
    """build_model(name) saved to `path`, built on the GPU where there is one (seconds instead of
    minutes of CPU initialisation for the larger shapes) and freed before this returns."""
    device = "cuda" if torch.cuda.is_available() else "cpu"
    build_model(name, device, num_layers).save_pretrained(path)
    if device == "cuda":
        torch.cuda.empty_cache()  # the next engine in this process sizes itself from free memory


def run(engine: Engine, prompts, mode: str, out_len: int, temperature: float) -> dict:
    """mode: off | verified | invariant, or verified-dvr (verified with DVR on every step)."""
    determinism, _, forced = mode.partition("-")
    params = [SamplingParams(max_tokens=out_len, temperature=temperature, seed=i, determinism=determinism)
              for i in range(len(prompts))]
    policy = engine.decode_policy
    if forced:
        engine.decode_policy = DecodePolicy(forced)
    if engine.device.type == "cuda":
        torch.cuda.synchronize()
    start = time.perf_counter()
    try:
        rollouts = engine.generate(prompts, params)
    finally:
        engine.decode_policy = policy
    if engine.device.type == "cuda":
        torch.cuda.synchronize()
    elapsed = time.perf_counter() - start
    generated = sum(len(r.token_ids) for r in rollouts)
    proposed = sum(r.stats.proposed_tokens for r in rollouts)
    return dict(mode=mode, seconds=round(elapsed, 3), tokens_per_s=round(generated / elapsed, 1),
                rollbacks_per_request=round(sum(r.stats.rollbacks for r in rollouts) / len(rollouts), 3),
                recomputed_fraction=round(sum(r.stats.recomputed_tokens for r in rollouts) / max(proposed, 1), 4),
                verify_windows_per_request=round(sum(r.stats.verify_windows for r in rollouts) / len(rollouts), 2))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="tiny", choices=sorted(SHAPES))
    ap.add_argument("--num-layers", type=int, default=None, help="fewer layers of the same shape")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--batch", default="8,64", help="comma-separated batch sizes")
    ap.add_argument("--prompt-len", type=int, default=512)
    ap.add_argument("--output-len", type=int, default=512)
    ap.add_argument("--window", type=int, default=16)
    ap.add_argument("--group", type=int, default=64)
    ap.add_argument("--temperature", type=float, default=0.0)
    ap.add_argument("--modes", default="off,verified,verified-dvr,invariant")
    ap.add_argument("--tree-segments", type=int, default=None,
                    help=f"row-parallel tree width, one of {K.TREE_WIDTHS} (default: {K.TREE_SEGMENTS_ENV} or 8)")
    ap.add_argument("--out", help="also write the JSON here")
    args = ap.parse_args()
    if args.tree_segments is not None:
        K.set_tree_segments(args.tree_segments)
    model = build_model(args.model, args.device, args.num_layers)
    vocab = model.config.vocab_size
    results = []
    for bs in (int(b) for b in args.batch.split(",")):
        rng = random.Random(bs)
        prompts = [[rng.randrange(vocab) for _ in range(args.prompt_len)] for _ in range(bs)]
        tokens = bs * (args.prompt_len + args.output_len + args.window + 16)
        engine = Engine(model, device=args.device, window=args.window, group=args.group, copy_model=False,
                        kv_cache_tokens=tokens, max_num_seqs=bs, max_prefill_tokens=8192)
        t0 = time.perf_counter()
        graphs = engine.capture_graphs()  # CUDA: every decode / verify shape, before timing
        for m in args.modes.split(","):  # warm-up: compile kernels, fill allocator pools
            run(engine, prompts, m, 2 * args.window, args.temperature)
        print(f"# batch {bs}: {graphs} graphs captured, warm-up {time.perf_counter() - t0:.1f}s", flush=True)
        row = dict(batch=bs, modes={m: run(engine, prompts, m, args.output_len, args.temperature)
                                    for m in args.modes.split(",")})
        tps = {m: r["tokens_per_s"] for m, r in row["modes"].items()}
        if "off" in tps and "verified" in tps:
            row["verified_over_off"] = round(tps["verified"] / tps["off"], 3)
        if "invariant" in tps and "verified" in tps:
            row["verified_over_invariant"] = round(tps["verified"] / tps["invariant"], 3)
        if "off" in tps and "verified-dvr" in tps:
            row["dvr_over_off"] = round(tps["verified-dvr"] / tps["off"], 3)
        row["auto_policy_tokens_per_s"] = engine.decode_policy.rates()
        results.append(row)
        print(json.dumps(row), flush=True)
    doc = dict(model=args.model, device=torch.cuda.get_device_name() if args.device == "cuda" else "cpu",
               prompt_len=args.prompt_len, output_len=args.output_len, window=args.window, group=args.group,
               temperature=args.temperature, tree_segments=K.tree_segments(), results=results)
    emit(doc, args.out)


if __name__ == "__main__":
    main()
