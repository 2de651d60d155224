"""Build a ``CausalLM`` on the meta device and fill it straight from safetensors files.

The model is created without storage (``torch.device("meta")``), then each parameter gets
uninitialised storage on its die and every checkpoint tensor is copied into place from the
memory-mapped file, so the weights exist once in memory (plus the page cache). Fused
parameters (qkv, gate_up) are filled slice by slice. safetensors only: never pickle.
"""

from __future__ import annotations

import json
import struct
from collections.abc import Callable
from pathlib import Path

import torch
from safetensors import safe_open

from workers.errors import LoadError
from workers.model import CausalLM
from workers.model_config import ModelConfig, load_config

DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}
_ST_DTYPE_BYTES = {"BF16": 2, "F16": 2, "F32": 4, "F64": 8, "I64": 8, "I32": 4, "I16": 2, "I8": 1, "U8": 1, "BOOL": 1}


def weight_files(model_dir: Path) -> list[Path]:
    """The checkpoint's safetensors files, from the shard index when there is one."""
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError, TypeError) as e:
            raise LoadError("invalid", f"{index}: not a valid shard index ({e})") from None
        files = [model_dir / name for name in dict.fromkeys(weight_map.values())]
        for f in files:
            if not f.is_file():
                raise LoadError("not_found", f"{f}: shard named in {index.name} is missing")
        return files
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        found = sorted(p.name for p in model_dir.glob("*.bin")) + sorted(p.name for p in model_dir.glob("*.pt*"))
        hint = f" (found {', '.join(found)}: pickle checkpoints are never loaded)" if found else ""
        raise LoadError("not_found", f"{model_dir}: no *.safetensors weights{hint}")
    return files


def check_safetensors(path: Path) -> dict:
    """Parse the header ourselves so a truncated or corrupt file gets a clear error."""
    size = path.stat().st_size
    with path.open("rb") as f:
        head = f.read(8)
        if len(head) < 8:
            raise LoadError("invalid", f"{path}: truncated safetensors file ({size} bytes, no header)")
        (n,) = struct.unpack("<Q", head)
        if n > size - 8:
            raise LoadError("invalid", f"{path}: corrupt safetensors header (length {n} > file size {size})")
        try:
            header = json.loads(f.read(n))
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise LoadError("invalid", f"{path}: corrupt safetensors header ({e})") from None
    if not isinstance(header, dict):
        raise LoadError("invalid", f"{path}: corrupt safetensors header (not an object)")
    data_len = size - 8 - n
    for name, info in header.items():
        if name == "__metadata__":
            continue
        try:
            start, end = info["data_offsets"]
            nbytes = _ST_DTYPE_BYTES.get(info["dtype"], 0)
            numel = 1
            for d in info["shape"]:
                numel *= d
        except (KeyError, TypeError, ValueError):
            raise LoadError("invalid", f"{path}: corrupt safetensors entry for tensor {name!r}") from None
        if end > data_len:
            raise LoadError(
                "invalid", f"{path}: truncated safetensors file: tensor {name!r} ends at byte "
                f"{end} but the data section has {data_len}"
            )
        if nbytes and end - start != numel * nbytes:
            raise LoadError("invalid", f"{path}: corrupt safetensors entry for tensor {name!r} (size mismatch)")
    return header


def _targets(model: CausalLM, cfg: ModelConfig) -> dict[str, tuple[torch.Tensor, int, int]]:
    """Checkpoint tensor name -> (our parameter, row offset, rows) it fills."""
    t: dict[str, tuple[torch.Tensor, int, int]] = {
        "model.embed_tokens.weight": (model.embed_tokens.weight, 0, cfg.vocab_size),
        "model.norm.weight": (model.norm.weight, 0, cfg.hidden_size),
    }
    if model.lm_head is not None:
        t["lm_head.weight"] = (model.lm_head.weight, 0, cfg.vocab_size)
    q, kv, inter = cfg.q_size, cfg.kv_size, cfg.intermediate_size
    for i, layer in enumerate(model.layers):
        p = f"model.layers.{i}."
        a, m = layer.self_attn, layer.mlp
        for kind, (off, rows) in {"q": (0, q), "k": (q, kv), "v": (q + kv, kv)}.items():
            t[f"{p}self_attn.{kind}_proj.weight"] = (a.qkv_proj.weight, off, rows)
            if cfg.attention_bias:
                t[f"{p}self_attn.{kind}_proj.bias"] = (a.qkv_proj.bias, off, rows)
        t[f"{p}self_attn.o_proj.weight"] = (a.o_proj.weight, 0, cfg.hidden_size)
        if cfg.o_bias:
            t[f"{p}self_attn.o_proj.bias"] = (a.o_proj.bias, 0, cfg.hidden_size)
        if cfg.qk_norm:
            t[f"{p}self_attn.q_norm.weight"] = (a.q_norm.weight, 0, cfg.head_dim)
            t[f"{p}self_attn.k_norm.weight"] = (a.k_norm.weight, 0, cfg.head_dim)
        t[f"{p}mlp.gate_proj.weight"] = (m.gate_up_proj.weight, 0, inter)
        t[f"{p}mlp.up_proj.weight"] = (m.gate_up_proj.weight, inter, inter)
        t[f"{p}mlp.down_proj.weight"] = (m.down_proj.weight, 0, cfg.hidden_size)
        t[f"{p}input_layernorm.weight"] = (layer.input_layernorm.weight, 0, cfg.hidden_size)
        t[f"{p}post_attention_layernorm.weight"] = (layer.post_attention_layernorm.weight, 0, cfg.hidden_size)
    return t


def layer_placement(num_layers: int, devices: list[torch.device]) -> list[torch.device]:
    """Split layers into contiguous, near-equal runs, one run per device."""
    n = len(devices)
    return [devices[min(i * n // num_layers, n - 1)] for i in range(num_layers)]


def resolve_dtype(name: str, cfg: ModelConfig, device: torch.device) -> torch.dtype:
    if name == "auto":
        name = cfg.torch_dtype
        if name == "float16" and device.type == "cpu":
            name = "bfloat16"  # fp16 matmuls are slow on CPUs; bf16 has the same size and more range
    if name not in DTYPES:
        raise LoadError("invalid", f"dtype {name!r} is not one of auto, {', '.join(DTYPES)}")
    return DTYPES[name]


def load_model(
    model_dir: str | Path,
    devices: list[str] | None = None,
    dtype: str = "auto",
    progress: Callable[[int, int], None] | None = None,
) -> tuple[CausalLM, ModelConfig]:
    """Load a Hugging Face model folder onto ``devices`` (layers split across several)."""
    model_dir = Path(model_dir)
    cfg = load_config(model_dir)
    devs = [torch.device(d) for d in (devices or ["cpu"])]
    dt = resolve_dtype(dtype, cfg, devs[0])
    files = weight_files(model_dir)
    headers = {f: check_safetensors(f) for f in files}

    with torch.device("meta"):
        model = CausalLM(cfg)
    model.layer_devices = layer_placement(cfg.num_layers, devs)
    # Storage for every parameter on its die (uninitialised; filled below).
    model.embed_tokens.to_empty(device=devs[0])
    model.norm.to_empty(device=devs[0])
    if model.lm_head is not None:
        model.lm_head.to_empty(device=devs[0])
    for layer, dev in zip(model.layers, model.layer_devices):
        layer.to_empty(device=dev)
    model.to(dt)

    targets = _targets(model, cfg)
    filled: set[str] = set()
    total, done = len(targets), 0
    for f in files:
        names = [n for n in headers[f] if n != "__metadata__"]
        try:
            with safe_open(str(f), framework="pt", device="cpu") as st:
                for name in names:
                    if name not in targets:
                        continue  # e.g. rotary inv_freq buffers some checkpoints carry
                    param, off, rows = targets[name]
                    src = st.get_tensor(name)
                    want = (rows,) + tuple(param.shape[1:])
                    if tuple(src.shape) != want:
                        raise LoadError(
                            "invalid", f"{f}: tensor {name!r} has shape {list(src.shape)}, "
                            f"expected {list(want)} from config.json"
                        )
                    with torch.no_grad():
                        param[off : off + rows].copy_(src)
                    del src
                    filled.add(name)
                    done += 1
                    if progress:
                        progress(done, total)
        except LoadError:
            raise
        except Exception as e:  # safetensors raises its own error types for damaged files
            raise LoadError("invalid", f"{f}: cannot read safetensors ({e})") from None

    missing = [n for n in targets if n not in filled]
    if missing == ["lm_head.weight"]:
        # No lm_head in the checkpoint: tie it to the embeddings, as transformers does.
        model.lm_head = None
        missing = []
    if missing:
        shown = ", ".join(missing[:3]) + (f" and {len(missing) - 3} more" if len(missing) > 3 else "")
        raise LoadError("invalid", f"{model_dir}: checkpoint lacks tensor(s) {shown}")
    model.eval()
    return model, cfg
