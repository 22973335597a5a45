"""The shapes of a decoder that its memory estimate needs (recipes.memory_plan), and what autograd keeps per
token of each of its layers."""
from __future__ import annotations

from dataclasses import dataclass

FP32, BF16 = 4, 2

# -- activations autograd keeps, per token -----------------------------------------------------------------
# Counted in kernels/forward.py decoder_layer_forward and the autograd Functions of kernels/backward.py that
# it calls with gradients on (every tensor bf16; the weights they save are FSDP2's gathered parameters,
# whose storage FSDP2 frees after the layer, so they are not activations):
#   rms_norm of the layer's input (_CanonicalRmsNorm)       saves its input x            [hidden]
#   q, k, v projections (_CanonicalLinear)                  save the normed input        [hidden] (one tensor)
#   q_norm, k_norm (Qwen3 only, _CanonicalRmsNorm)          save q and k before the norm [q], [kv]
#   rotary_qk (_CanonicalRotaryQK)                          saves cos, sin only (shared by every layer)
#   attention (_CanonicalAttention)                         saves rotated q, k and v     [q], [kv], [kv]
#   o_proj (_CanonicalLinear)                               saves the attention output   [q]
#   add_rms_norm after attention (_CanonicalAddRmsNorm)     saves the residual sum       [hidden]
#   gate and up projections (_CanonicalLinear)              save the normed input        [hidden] (one tensor)
#   silu_mul (_CanonicalSiluMul)                            saves gate and up            [inter], [inter]
#   down_proj (_CanonicalLinear)                            saves their product          [inter]
#   the residual add (_CanonicalAdd)                        saves nothing
# where q = heads x head_dim, kv = kv_heads x head_dim, inter = intermediate_size.
SAVED_HIDDEN_PER_LAYER = 4
SAVED_QUERY_PER_LAYER = 2  # + 1 with q_norm
SAVED_KV_PER_LAYER = 2  # + 1 with k_norm
SAVED_INTERMEDIATE_PER_LAYER = 3
# MoE layers (kernels/moe.py experts_loop), per expert a token is routed to: gate and up, their contiguous
# copies and their product [moe_intermediate] each; the token's gathered input row and the expert's output
# (bf16) and its weighted float32 contribution [hidden]: 2 + 2 + 4 bytes.
SAVED_MOE_INTERMEDIATE_PER_EXPERT = 5
SAVED_MOE_HIDDEN_BYTES_PER_EXPERT = BF16 + BF16 + FP32
# After the last layer (trainer_patch's head): the final norm's input and the scored rows
# hidden[:, :-1][where] that kernels.head_token_logprobs saves, [hidden] each.
SAVED_HIDDEN_AFTER_LAYERS = 2
# The float32 rotary rows, cos and sin [head_dim] per token: one pair for all layers.
ROTARY_BYTES_PER_HEAD_DIM = 2 * FP32


@dataclass(frozen=True)
class ModelShape:
    """The shapes of a decoder the estimate needs, from its Hugging Face config (ModelShape.of)."""
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    vocab: int
    tied_embeddings: bool
    qk_norm: bool = False  # Qwen3: q_norm and k_norm in every layer
    qkv_bias: bool = False  # Qwen2: biases on q, k and v
    experts: int = 0  # MoE layers: experts per layer (0: dense)
    experts_per_token: int = 0
    moe_intermediate: int = 0
    sparse_layers: int = 0  # how many layers are MoE

    @classmethod
    def of(cls, config) -> ModelShape:
        heads = config.num_attention_heads
        experts = getattr(config, "num_experts", 0) or 0
        return cls(hidden=config.hidden_size, layers=config.num_hidden_layers, heads=heads,
                   kv_heads=getattr(config, "num_key_value_heads", None) or heads,
                   head_dim=getattr(config, "head_dim", None) or config.hidden_size // heads,
                   intermediate=config.intermediate_size, vocab=config.vocab_size,
                   tied_embeddings=bool(getattr(config, "tie_word_embeddings", False)),
                   qk_norm=config.model_type in ("qwen3", "qwen3_moe"),
                   qkv_bias=bool(getattr(config, "attention_bias", config.model_type == "qwen2")),
                   experts=experts, experts_per_token=getattr(config, "num_experts_per_tok", 0) if experts else 0,
                   moe_intermediate=getattr(config, "moe_intermediate_size", 0) if experts else 0,
                   sparse_layers=_sparse_layers(config) if experts else 0)

    @property
    def q_width(self) -> int:
        return self.heads * self.head_dim

    @property
    def kv_width(self) -> int:
        return self.kv_heads * self.head_dim

    @property
    def attention_params(self) -> int:
        h, q, kv = self.hidden, self.q_width, self.kv_width
        bias = q + 2 * kv if self.qkv_bias else 0
        norms = 2 * self.head_dim if self.qk_norm else 0
        return h * q + 2 * h * kv + q * h + bias + norms

    @property
    def dense_layer_params(self) -> int:
        return self.attention_params + 2 * self.hidden + 3 * self.hidden * self.intermediate

    @property
    def sparse_layer_params(self) -> int:
        experts = self.experts * 3 * self.hidden * self.moe_intermediate
        return self.attention_params + 2 * self.hidden + experts + self.hidden * self.experts  # + the router

    @property
    def largest_layer_params(self) -> int:
        return max(self.dense_layer_params, self.sparse_layer_params if self.sparse_layers else 0)

    @property
    def root_params(self) -> int:
        """The embedding, the lm head (unless tied) and the final norm: FSDP2's root group."""
        return self.vocab * self.hidden * (1 if self.tied_embeddings else 2) + self.hidden

    @property
    def params(self) -> int:
        dense = self.layers - self.sparse_layers
        return dense * self.dense_layer_params + self.sparse_layers * self.sparse_layer_params + self.root_params

    def saved_bytes_per_token(self, sparse: bool) -> int:
        """What autograd keeps per token in one layer (see SAVED_*)."""
        qk = 1 if self.qk_norm else 0
        elements = (SAVED_HIDDEN_PER_LAYER * self.hidden + (SAVED_QUERY_PER_LAYER + qk) * self.q_width
                    + (SAVED_KV_PER_LAYER + qk) * self.kv_width)
        if not sparse:
            return BF16 * (elements + SAVED_INTERMEDIATE_PER_LAYER * self.intermediate)
        k = self.experts_per_token
        return (BF16 * (elements + SAVED_MOE_INTERMEDIATE_PER_EXPERT * k * self.moe_intermediate)
                + SAVED_MOE_HIDDEN_BYTES_PER_EXPERT * k * self.hidden)

    @property
    def largest_layer_saved_bytes_per_token(self) -> int:
        dense = self.saved_bytes_per_token(False) if self.sparse_layers < self.layers else 0
        return max(dense, self.saved_bytes_per_token(True) if self.sparse_layers else 0)

    @property
    def all_layers_saved_bytes_per_token(self) -> int:
        dense = self.layers - self.sparse_layers
        sparse = self.saved_bytes_per_token(True) * self.sparse_layers if self.sparse_layers else 0
        return dense * self.saved_bytes_per_token(False) + sparse

    def projection_in_out(self, name: str) -> tuple[int, int]:
        """(in, out) features of a dense decoder projection by its Hugging Face name."""
        h, q, kv, i = self.hidden, self.q_width, self.kv_width, self.intermediate
        return {"q_proj": (h, q), "k_proj": (h, kv), "v_proj": (h, kv), "o_proj": (q, h),
                "gate_proj": (h, i), "up_proj": (h, i), "down_proj": (i, h)}[name]

    def lora_params(self, r: int, targets: list[str]) -> int:
        """A LoRA adapter's parameters: A [r, in] and B [out, r] per target projection of every layer."""
        return self.layers * sum(r * sum(self.projection_in_out(t)) for t in targets)

    @property
    def state_dict_numel(self) -> int:
        """Elements of the state dict a push sends: a tied lm head is an entry of its own there."""
        return self.params + (self.vocab * self.hidden if self.tied_embeddings else 0)

    @property
    def kv_bytes_per_token(self) -> int:
        """A bf16 KV cache's bytes per token (every layer's K and V)."""
        return self.layers * 2 * self.kv_width * BF16


def _sparse_layers(config) -> int:
    """Qwen3-MoE: layers whose MLP is the sparse block (decoder_sparse_step, mlp_only_layers)."""
    step = getattr(config, "decoder_sparse_step", 1) or 1
    dense = set(getattr(config, "mlp_only_layers", None) or ())
    return sum(1 for i in range(config.num_hidden_layers) if i not in dense and (i + 1) % step == 0)
