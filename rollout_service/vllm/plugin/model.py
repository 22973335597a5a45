"""ZeroKLForCausalLM: a vLLM model class whose forward is the canonical forward (kernels.forward).

It holds the plain Hugging Face model of the checkpoint's config (Llama / Qwen2 / Qwen3 / Qwen3-MoE, chosen by
model_type, so `hf_overrides={"architectures": [...]}` does not lose it) with bf16 parameters under
their checkpoint names, plus one vLLM `Attention` layer per decoder layer (`...self_attn.attn`) that
only holds that layer's paged KV cache. vLLM's flat token batch is laid out as [N, 1]: every token is
its own row with its own absolute position and its sequence's block table, so the canonical attention
visits keys 0..position of each row exactly as a whole-sequence training forward does (eager steps
with prefill chunks attend those chunks as [chunks, length] rows: same numbers, fewer key loads).
"""
from __future__ import annotations

import copy
import re
from typing import Iterable

import torch
from torch import nn
from vllm.config import VllmConfig
from vllm.forward_context import get_forward_context
from vllm.model_executor.layers.attention import Attention
from vllm.model_executor.model_loader.weight_utils import default_weight_loader

from kernels.forward import compute_logits, forward_hidden, fuse_projections, model_spec, rope_table
from kernels.moe import is_moe_block
from rollout_service.vllm.plugin.attention import PagedKVAdapter, ZeroKLAttentionBackend
from rollout_service.vllm.plugin.lora import HINT_KEY, PolicyAdapter
from rollout_service.vllm.plugin.runner_v2 import model_state_class
from rollout_service.vllm.plugin.tensor_parallel import PluginTP
from rollout_service.weights import CopyGroup


def build_hf_model(hf_config, device: torch.device) -> nn.Module:
    """The transformers model for `hf_config` (by its config class), bf16, uninitialised storage."""
    import transformers
    with torch.device("meta"):
        hf = transformers.AutoModelForCausalLM.from_config(copy.deepcopy(hf_config))
    hf.config.architectures = [type(hf).__name__]  # the original class, not our override
    # weights come from load_weights; rotary buffers are never read (kernels.rope uses the config)
    hf = hf.to(torch.bfloat16).to_empty(device=device).eval()
    hf.tie_weights()  # to_empty gives every module its own new parameter: re-tie lm_head to the embedding
    return hf


class ZeroKLForCausalLM(nn.Module):
    # vLLM's SupportsLoRA declaration, so enable_lora builds: the adapters are then RequestAdapters', which
    # compat.install_lora_manager makes this model's runner use (plugin/request_adapters.py says why)
    supports_lora = True
    packed_modules_mapping: dict[str, list[str]] = {}
    embedding_modules: dict[str, str] = {}

    def __init__(self, *, vllm_config: VllmConfig, prefix: str = ""):
        super().__init__()
        tp = PluginTP.from_vllm(vllm_config)
        model_config = vllm_config.model_config
        if not vllm_config.use_v2_model_runner and (not model_config.logits_processors
                                                    or model_config.logprobs_mode != "processed_logits"):
            # V2 installs our sampler itself (get_model_state_cls); V1 would sample vLLM's way
            raise ValueError("ZeroKLForCausalLM on vLLM's V1 model runner samples through our logits processor: "
                             "build the engine with rollout_service.vllm.plugin.llm_options(checkpoint) "
                             "(logits_processors=[PROCESSOR_FQCN], logprobs_mode='processed_logits')")
        device = vllm_config.device_config.device
        full_config = model_config.hf_config
        hf = build_hf_model(tp.local_config(full_config), torch.device(device))  # this rank's shard
        tp.shard_lm_head(hf, full_config.vocab_size)
        fuse_projections(hf)  # one matmul for q/k/v and one for gate/up; load_weights fills the blocks
        self.__dict__["hf"] = hf  # not a submodule: parameters keep their checkpoint names
        self.model, self.lm_head = hf.model, hf.lm_head
        self.spec = spec = model_spec(hf)
        self.__dict__["tp"] = tp
        self.__dict__["ops"] = tp.ops(full_config.vocab_size)
        # a tied checkpoint has no lm_head.weight; a shard's lm_head is its own vocab slice of the embedding
        tied = getattr(full_config, "tie_word_embeddings", False)
        self.__dict__["lm_head_from_embedding"] = tp.world_size > 1 and tied
        for layer in hf.model.layers:  # MoE: checkpoints hold one tensor per expert, the model fused ones
            if is_moe_block(layer.mlp):
                for fused in (layer.mlp.experts.gate_up_proj, layer.mlp.experts.down_proj):
                    fused.weight_loader = load_expert_part
        attn = []
        for i, layer in enumerate(hf.model.layers):  # held inside the HF module: its name is its prefix
            layer.self_attn.attn = Attention(
                spec.num_heads, spec.head_dim, getattr(layer.self_attn, "scaling", spec.head_dim ** -0.5),
                num_kv_heads=spec.num_kv_heads, cache_config=vllm_config.cache_config,
                prefix=f"{prefix}model.layers.{i}.self_attn.attn", attn_backend=ZeroKLAttentionBackend)
            attn.append(layer.self_attn.attn)
        self.__dict__["attn_layers"] = attn  # layer_idx order, as kernels.forward indexes them
        # every position a request can reach, on the device now: no forward grows it or checks for growth
        rope = rope_table(hf)
        rope.bound(vllm_config.model_config.max_model_len, torch.device(device))
        # Rule: whatever the forward reads besides the weights is a registered buffer, because vLLM's
        # level-2 sleep discards all that load_model allocated and brings back only the weights (loaded
        # again) and the buffers (saved and restored in place)
        self.register_buffer("rope_cos", rope.cos, persistent=False)
        self.register_buffer("rope_sin", rope.sin, persistent=False)
        # a LoRA adapter applied to every token (plugin/lora.py); sized now when hf_overrides hint at one
        graphs = torch.device(device).type == "cuda" and not model_config.enforce_eager
        self.__dict__["adapter"] = PolicyAdapter(hf, torch.device(device), graphs, getattr(full_config, HINT_KEY, None),
                                                 per_request=vllm_config.lora_config is not None)

    def load_adapter(self, adapter) -> int:
        """Apply a rollout_service.lora.LoraAdapter to every token from the next forward on (checked first)."""
        if self.tp.world_size > 1:
            raise ValueError("a LoRA adapter in the canonical vLLM model runs at tensor_parallel_size=1 only")
        if self.__dict__.get("request_adapters") is not None:
            raise ValueError("this engine serves per-request adapters (enable_lora): name one in each request "
                             "with a LoRARequest instead of loading one for every token")
        return self.adapter.load(adapter)

    def use_request_adapters(self, adapters) -> None:
        """Per-request LoRA (plugin/request_adapters.RequestAdapters) from the next forward on."""
        if self.tp.world_size > 1:
            raise ValueError("enable_lora on the canonical vLLM model runs at tensor_parallel_size=1 only")
        self.__dict__["request_adapters"] = adapters

    def _lora_rows(self, num_tokens: int):
        adapters = self.__dict__.get("request_adapters")
        return self.adapter.rows if adapters is None else adapters.rows(num_tokens)

    @classmethod
    def get_model_state_cls(cls):
        """vLLM's V2 model runner: our model state, which installs the zerokl sampler (runner_v2)."""
        return model_state_class()

    def embed_input_ids(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.model.embed_tokens(input_ids)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, intermediate_tensors=None,
                inputs_embeds: torch.Tensor | None = None, **kwargs) -> torch.Tensor:
        if inputs_embeds is not None or intermediate_tensors is not None:
            raise NotImplementedError("ZeroKLForCausalLM takes token ids on a single pipeline stage")
        metadata = get_forward_context().attn_metadata
        if isinstance(metadata, list):  # speculative decoding: [0] is the target model's
            metadata = metadata[0]
        num_tokens = input_ids.shape[0]
        if metadata is None:  # profiling / warm-up: no cache; each token alone at position 0
            ids = input_ids.reshape(-1, 1)
            return forward_hidden(self.hf, ids, torch.zeros_like(ids), ops=self.ops,
                                  lora=self._lora_rows(num_tokens)).reshape(num_tokens, -1)
        md = metadata[self.attn_layers[0].layer_name]  # one metadata object serves every layer
        # every token vLLM hands over, padding included: a replayed CUDA graph has the padded shape
        kv = PagedKVAdapter([a.kv_cache for a in self.attn_layers], md, self.spec.head_dim, num_tokens)
        ids, pos = input_ids.reshape(num_tokens, 1), positions.reshape(num_tokens, 1)
        return forward_hidden(self.hf, ids, pos, ops=self.ops, kv=kv,
                              lora=self._lora_rows(num_tokens)).reshape(num_tokens, -1)

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """float32 canonical logits over the full vocabulary (on every rank); from the sampler's graphs
        where it has them (use_sampler_graphs), else eagerly."""
        graphs = self.__dict__.get("sampler_graphs")
        if graphs is not None:
            logits = graphs.compute_logits(hidden_states, self._head)
            if logits is not None:
                return logits
        return self._head(hidden_states)

    def _head(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return compute_logits(self.hf, hidden_states, self.ops)

    def use_sampler_graphs(self, graphs) -> None:
        """Logits of up to graphs.max_rows rows come from graphs.compute_logits: the lm_head product
        replayed into the buffer the sampling graphs read (one rank only: under tensor parallelism the
        product ends in a collective, kept eager)."""
        if self.tp.world_size == 1:
            self.__dict__["sampler_graphs"] = graphs

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Copies Hugging Face-named tensors into the bf16 parameters (a cast rounds to nearest, as
        from_pretrained(dtype=torch.bfloat16) does); returns the names loaded. Per-expert checkpoint
        tensors (`mlp.experts.<e>.{gate,up,down}_proj.weight`) go into their slice of the fused
        expert parameters. Under tensor parallelism each rank loads its slice of every tensor."""
        if "_parameter_owners" not in self.__dict__:
            # Each parameter's module and attribute, found once: rebuilding a dict of every parameter per
            # call (TRL's colocate sync calls once per tensor), or get_parameter's walk per tensor, costs
            # more host time than the copies. Tensors are looked up in their module at each call, so a
            # parameter replaced later (a reload) is the one filled. The names loaded are the parameters'
            # own (a tied one's second name is not); the owners cover every name.
            modules = dict(self.named_modules(remove_duplicate=False))
            self.__dict__["_parameter_owners"] = {
                name: (modules[name.rpartition(".")[0]], name.rpartition(".")[2])
                for name, _ in self.named_parameters(remove_duplicate=False)}
            self.__dict__["_parameter_names"] = frozenset(name for name, _ in self.named_parameters())
        owners, names = self.__dict__["_parameter_owners"], self.__dict__["_parameter_names"]

        def parameter(name: str) -> torch.nn.Parameter:
            module, attr = owners[name]
            return module._parameters[attr]

        loaded = set()
        copies = CopyGroup()  # issued together: see _load
        for name, tensor in weights:
            expert = EXPERT_TENSOR.fullmatch(name)
            if expert is not None:
                prefix, e, part = expert.group("prefix", "expert", "part")
                fused = f"{prefix}.{'down_proj' if part == 'down' else 'gate_up_proj'}"
                if fused in names:
                    # through the parameter's weight_loader: vLLM's in-place reload wraps it to stage the copy
                    param = parameter(fused)
                    param.weight_loader(param, tensor, int(e), part)
                    loaded.add(fused)
                    continue
            if name == "model.embed_tokens.weight" and self.lm_head_from_embedding:
                self._load(copies, parameter("lm_head.weight"), self.tp.shard("lm_head.weight", tensor),
                           "lm_head.weight")
                loaded.add("lm_head.weight")
            if name not in names:  # e.g. rotary inv_freq, or lm_head.weight of a tied checkpoint
                continue
            self._load(copies, parameter(name), self.tp.shard(name, tensor), name)
            loaded.add(name)
        copies.flush()
        return loaded

    @staticmethod
    def _load(copies: CopyGroup, param: torch.Tensor, tensor: torch.Tensor, name: str) -> None:
        """Through the parameter's own weight_loader where it has one (vLLM's in-place reload wraps
        them); else the copy vLLM's default_weight_loader makes, added to `copies`."""
        if param.shape != tensor.shape:
            raise ValueError(f"{name}: checkpoint shape {tuple(tensor.shape)} != model {tuple(param.shape)}")
        loader = getattr(param, "weight_loader", default_weight_loader)
        if loader is default_weight_loader:
            copies.add(param.data, tensor)
        else:
            loader(param, tensor)


EXPERT_TENSOR = re.compile(r"(?P<prefix>.+\.mlp\.experts)\.(?P<expert>\d+)\.(?P<part>gate|up|down)_proj\.weight")


def load_expert_part(param: torch.Tensor, loaded_weight: torch.Tensor, expert: int | None = None,
                     part: str | None = None) -> None:
    """One expert's gate / up / down matrix into the fused [E, 2I, H] gate_up or [E, H, I] down
    parameter (transformers' layout: gate rows before up rows); without `expert`, the whole fused
    tensor (a trainer's state dict)."""
    if expert is None:
        target = param.data
    elif part == "down":
        target = param.data[expert]
    else:
        inter = param.shape[1] // 2
        target = param.data[expert, :inter] if part == "gate" else param.data[expert, inter:]
    if target.shape != loaded_weight.shape:
        raise ValueError(f"expert {expert} {part}: checkpoint shape {tuple(loaded_weight.shape)} != "
                         f"model {tuple(target.shape)}")
    target.copy_(loaded_weight)  # a bf16 cast rounds to nearest, as from_pretrained does
