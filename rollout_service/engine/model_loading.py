"""Where an engine's model comes from: a model object, a local checkpoint directory or a "tiny:" name,
loaded as a bf16 inference model (load_model), or checked without loading (check_model_source)."""
from __future__ import annotations

import copy
import json
from pathlib import Path

import torch

from kernels.forward import SUPPORTED_ARCHITECTURES, model_spec
from rollout_service.tiny_models import ARCHITECTURES, TINY_PREFIX, tiny_model


def load_model(model, device, copy_model: bool = True) -> torch.nn.Module:
    """An HF causal LM as a bf16 inference model on `device`.

    `model`: a model object, a local checkpoint directory, or "tiny:{llama,qwen2,qwen3}" (a tiny
    random model, rollout_service.tiny_models; the same names everywhere: Engine, workers, the audit).
    """
    if isinstance(model, str) and model.startswith(TINY_PREFIX):
        model = tiny_model(model[len(TINY_PREFIX):])
    elif isinstance(model, (str, Path)):
        path = Path(model)
        if not path.is_dir():
            raise FileNotFoundError(f"model path {str(model)!r} is not a local directory "
                                    f"(no model hub is contacted; pass a saved checkpoint, "
                                    f"{TINY_PREFIX}<{'|'.join(ARCHITECTURES)}> or a model object)")
        import transformers
        model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16)
    elif not isinstance(model, torch.nn.Module):
        raise TypeError(f"model must be a Hugging Face model or a local path, got {type(model).__name__}")
    elif copy_model:
        model = copy.deepcopy(model)
    model_spec(model)  # supported architecture?
    return model.to(device=device, dtype=torch.bfloat16).eval().requires_grad_(False)


def check_model_source(model) -> None:
    """What can be checked of a model without loading it, so that a bad one fails at the call with a
    one-line FileNotFoundError / ValueError (inside a worker it would surface as an actor's death):
    a "tiny:" name, or a checkpoint directory whose config loads, names a supported architecture and
    whose safetensors files are complete."""
    if isinstance(model, str) and model.startswith(TINY_PREFIX):
        if model[len(TINY_PREFIX):] not in ARCHITECTURES:
            raise ValueError(f"unknown tiny model {model!r}: use {TINY_PREFIX}<{'|'.join(ARCHITECTURES)}>")
        return
    if not isinstance(model, (str, Path)):
        return
    path = Path(model)
    if not path.is_dir():
        raise FileNotFoundError(f"model path {str(model)!r} is not a local directory (no model hub is contacted; "
                                f"pass a saved checkpoint, {TINY_PREFIX}<{'|'.join(ARCHITECTURES)}> or a model object)")
    import transformers
    try:
        config = transformers.AutoConfig.from_pretrained(path)
    except Exception as e:
        raise ValueError(f"model path {str(path)!r}: its config does not load ({type(e).__name__}: "
                         f"{str(e).splitlines()[0] if str(e) else ''})") from None
    archs = getattr(config, "architectures", None) or []
    if not set(archs) & set(SUPPORTED_ARCHITECTURES):
        raise ValueError(f"model path {str(path)!r}: architecture {archs} is not supported "
                         f"(supported: {', '.join(SUPPORTED_ARCHITECTURES)})")
    files = sorted(path.glob("*.safetensors"))
    if not files and not list(path.glob("*.bin")):
        raise FileNotFoundError(f"model path {str(path)!r} has no weights (*.safetensors or *.bin)")
    for f in files:
        _check_safetensors(f)


def _check_safetensors(path: Path) -> None:
    """ValueError unless the file is as long as its header says (a truncated copy is not)."""
    size = path.stat().st_size
    with open(path, "rb") as fh:
        head = fh.read(8)
        n = int.from_bytes(head, "little") if len(head) == 8 else -1
        header = fh.read(n) if 0 < n <= size - 8 else b""
    try:
        meta = json.loads(header)
        end = max((v["data_offsets"][1] for k, v in meta.items() if k != "__metadata__"), default=0)
    except (ValueError, KeyError, TypeError):
        raise ValueError(f"{str(path)!r} is not a readable safetensors file") from None
    if size != 8 + n + end:
        raise ValueError(f"{str(path)!r} is truncated or corrupt: {size} bytes, its header describes {8 + n + end}")
