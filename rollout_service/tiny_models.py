"""Tiny randomly initialised Llama / Qwen2 / Qwen3 / Qwen3-MoE models: no downloads, seconds on a CPU."""
from __future__ import annotations

import torch

ARCHITECTURES = ("llama", "qwen2", "qwen3", "qwen3_moe")
# "tiny:qwen2" names a tiny model wherever a checkpoint path is accepted (rollout_service.engine.engine.load_model)
TINY_PREFIX = "tiny:"


def tiny_config(arch: str = "qwen2", vocab_size: int = 96, hidden_size: int = 64, num_layers: int = 2,
                num_heads: int = 4, num_kv_heads: int = 2, intermediate_size: int = 128,
                max_positions: int = 512, head_dim: int | None = None, num_experts: int = 8,
                num_experts_per_tok: int = 2, moe_intermediate_size: int | None = None,
                tie_word_embeddings: bool = False):
    import transformers
    common = dict(vocab_size=vocab_size, hidden_size=hidden_size, intermediate_size=intermediate_size,
                  num_hidden_layers=num_layers, num_attention_heads=num_heads,
                  num_key_value_heads=num_kv_heads, max_position_embeddings=max_positions,
                  tie_word_embeddings=tie_word_embeddings, bos_token_id=None, eos_token_id=None, pad_token_id=None)
    if arch == "llama":
        return transformers.LlamaConfig(**common)
    if arch == "qwen2":
        return transformers.Qwen2Config(**common)
    head_dim = head_dim or hidden_size // num_heads
    if arch == "qwen3":
        return transformers.Qwen3Config(head_dim=head_dim, **common)
    if arch == "qwen3_moe":  # every layer sparse (tiny default: 8 experts, 2 per token)
        return transformers.Qwen3MoeConfig(head_dim=head_dim, num_experts=num_experts,
                                           num_experts_per_tok=num_experts_per_tok,
                                           moe_intermediate_size=moe_intermediate_size or intermediate_size // 2,
                                           decoder_sparse_step=1, mlp_only_layers=[], norm_topk_prob=True, **common)
    raise ValueError(f"unknown tiny architecture {arch!r}; choose from {ARCHITECTURES}")


MATRIX_STD, MATRIX_STD_WIDTH = 0.08, 128  # tiny_model's init: std MATRIX_STD up to this input width


def tiny_model(arch: str = "qwen2", seed: int = 0, dtype: torch.dtype = torch.bfloat16, **config_kwargs):
    """A randomly initialised causal LM (weights scaled up so that outputs are not near-uniform).

    Matrices get std 0.08 up to an input width of 128 and 0.08 * sqrt(128 / width) beyond, so that no
    projection multiplies its input's scale by more than 0.08 * sqrt(128) ~ 0.9. Rule: a wider random
    model at a fixed std is chaotic (at Qwen2.5-1.5B widths 0.08 gives gains of 3 to 8 per projection):
    rounding differences grow through its layers, and stock bf16 numerics then disagree with any other
    by whole nats per token, where a trained model's disagree by about 1e-3."""
    import transformers
    cfg = tiny_config(arch, **config_kwargs)
    torch.manual_seed(seed)
    model_cls = {"llama": transformers.LlamaForCausalLM, "qwen2": transformers.Qwen2ForCausalLM,
                 "qwen3": transformers.Qwen3ForCausalLM, "qwen3_moe": transformers.Qwen3MoeForCausalLM}[arch]
    model = model_cls(cfg)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() >= 2:  # matrices, and the experts' stacked [E, out, in] weights
                p.normal_(0.0, MATRIX_STD * min(1.0, (MATRIX_STD_WIDTH / p.shape[-1]) ** 0.5))
            elif name.endswith("bias"):
                p.normal_(0.0, 0.02)
    return model.to(dtype).eval()


def save_with_word_tokenizer(model, path: str) -> None:
    """Save a random-weight model with a word-level tokenizer over its ids ("t<i>" is id i; the last
    three ids are <unk>, <pad> and <eos>, which the model's configs name), as a user's checkpoint
    directory holds both (TRL and `vllm serve` load the tokenizer from it)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast
    n = model.config.vocab_size
    vocab = {f"t{i}": i for i in range(n - 3)} | {"<unk>": n - 3, "<pad>": n - 2, "<eos>": n - 1}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", pad_token="<pad>", eos_token="<eos>")
    model.config.eos_token_id = model.generation_config.eos_token_id = vocab["<eos>"]
    model.config.pad_token_id = model.generation_config.pad_token_id = vocab["<pad>"]
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)


# The byte-level tokenizer's special tokens (Qwen's names and chat markup), after its 256 byte ids
BYTE_SPECIALS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
BYTE_CHAT_TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
                      "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def byte_level_tokenizer():
    """A tokenizer of 259 ids for real text with no download: each UTF-8 byte is one id (byte-level BPE
    with no merges), then <|endoftext|> (pad), <|im_start|> and <|im_end|> (eos), and a ChatML template.
    Text costs one token a byte, so a worked GSM8K solution is a completion of a few hundred tokens."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast
    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    vocab = {ch: i for i, ch in enumerate(alphabet)} | {s: len(alphabet) + i for i, s in enumerate(BYTE_SPECIALS)}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>",
                                        additional_special_tokens=list(BYTE_SPECIALS))
    tokenizer.chat_template = BYTE_CHAT_TEMPLATE
    return tokenizer
