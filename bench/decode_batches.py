"""How vLLM's scheduler batches a workload under a given KV cache: its decode steps by batch size (the
rows every product of a step sees) and its prefill tokens, the recompute of preempted sequences
included. The schedule depends on token counts and cache blocks, not on the model's numbers, so a tiny
random model gives a GPU run's schedule on any machine.

    python -m bench.decode_batches --prompts 256 --prompt-len 512 --max-tokens 512 --cache-tokens 121600

Prints one JSON object: the decode steps per band of the launch tables (bench.vllm_step_profile's
step_rows) and per 16 rows, and the prefill steps with their tokens. On CPU vLLM's attention takes
blocks of 32 tokens (16 on GPUs), so the cache is allocated more coarsely than on a GPU.
"""
from __future__ import annotations

import argparse
import collections
import os
import random
import sys
import tempfile

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from bench import emit  # noqa: E402
from bench.peer.systems import TINY_KW  # noqa: E402
from bench.step_profile.host_times import record_step_rows, step_rows  # noqa: E402


def decode_rows_by_16(steps: list[tuple[int, int, int]]) -> dict[str, int]:
    """Decode steps (one token per request) counted per 16 rows: "1-16", "17-32", ..."""
    counts = collections.Counter((requests - 1) // 16 for tokens, requests, single in steps if single == requests)
    return {f"{16 * b + 1}-{16 * b + 16}": counts[b] for b in sorted(counts)}


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--prompts", type=int, default=256)
    p.add_argument("--prompt-len", type=int, default=512)
    p.add_argument("--max-tokens", type=int, default=512)
    p.add_argument("--cache-tokens", type=int, default=121_600,
                   help="KV cache size in tokens (default: Llama-3.1-8B's on an H100 at a 0.4 memory share)")
    p.add_argument("--max-num-batched-tokens", type=int, default=16_384,
                   help="tokens per step (vLLM's default for the LLM class on the GPUs the tables ran on)")
    p.add_argument("--block-size", type=int, help="tokens per cache block (default: 32 on CPU, 16 on GPU)")
    p.add_argument("--out")
    args = p.parse_args()
    import torch
    from vllm import LLM, SamplingParams

    from rollout_service.tiny_models import tiny_model
    from rollout_service.vllm.plugin.compat import engine_core_placement
    block = args.block_size or (16 if torch.cuda.is_available() else 32)
    max_len = args.prompt_len + args.max_tokens + 8
    steps = record_step_rows()  # the scheduler runs in this process (in-process engine core below)
    with tempfile.TemporaryDirectory(prefix="decode-batches-") as model_dir:
        tiny_model("llama", seed=0, max_positions=max_len, **TINY_KW).save_pretrained(model_dir)
        # CPU: room for the cache (the tiny model's KV is 512 bytes a token), not a share of the host's memory
        options = ({} if torch.cuda.is_available()
                   else dict(enforce_eager=True, kv_cache_memory_bytes=max(64 << 20, 1024 * args.cache_tokens)))
        with engine_core_placement(False):
            llm = LLM(model=model_dir, dtype="bfloat16", skip_tokenizer_init=True, max_model_len=max_len,
                      max_num_seqs=args.prompts, block_size=block, max_num_batched_tokens=args.max_num_batched_tokens,
                      num_gpu_blocks_override=-(-args.cache_tokens // block), enable_prefix_caching=True, seed=0,
                      **options)
        rng = random.Random(0)
        vocab = llm.llm_engine.model_config.get_vocab_size()
        prompts = [{"prompt_token_ids": [rng.randrange(vocab) for _ in range(args.prompt_len)]}
                   for _ in range(args.prompts)]
        # greedy: the sampler does not matter to the schedule
        params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True, detokenize=False)
        steps.clear()
        llm.generate(prompts, params, use_tqdm=True)
    rows = step_rows(steps)
    emit(dict(benchmark="decode_batches", prompts=args.prompts, prompt_len=args.prompt_len,
              max_tokens=args.max_tokens, block_size=block, max_num_batched_tokens=args.max_num_batched_tokens,
              cache_tokens=llm.llm_engine.vllm_config.cache_config.num_gpu_blocks * block, **rows,
              recomputed_tokens=rows["prompt_tokens"] - args.prompts * args.prompt_len,
              decode_rows_by_16=decode_rows_by_16(steps)), args.out)


if __name__ == "__main__":
    main()
