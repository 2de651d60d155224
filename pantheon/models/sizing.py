"""How much memory a model will take, from its ``config.json`` (or a GGUF file's metadata) alone
(no torch, no weights read).

The router admits a load against the dies' budgets *before* any worker touches the weights, so it
needs an estimate: parameters x dtype bytes for the weights, and K+V bytes per token for the KV
cache. After the load the worker reports the real figures (``Loaded.weight_bytes``/``kv_bytes``)
and those are booked instead.

The count follows the engine's Llama-family model exactly (``workers/model.py``): fused q/k/v and
gate/up, q/k/v biases for Qwen2 (and Llama/Qwen3 with ``attention_bias``), Qwen3's per-head q/k
norms, tied or untied LM head. Two engine details matter for the figure:

- on CPU dies the layout is the CPU path's (``CPU_PATHS``): its dtype, and for packed paths a
  second copy of a tied ``vocab x hidden`` head;
- ``quantize`` turns the decoder's linear layers into int8 plus one scale per output row (the
  embeddings and the head stay): about half the weight memory of a bf16 model.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from pantheon.models.gguf import GGUFError, find_gguf, hf_config, read_gguf

SUPPORTED_ARCHITECTURES = ("LlamaForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM")
_DTYPE_BYTES = {"bfloat16": 2, "float16": 2, "float32": 4}
BLOCK_TOKENS = 16  # the engine's KV block size: pools are whole blocks


class SizingError(Exception):
    """The folder's ``config.json`` cannot be sized. ``kind``: not_found | unsupported | invalid."""

    def __init__(self, kind: str, reason: str):
        super().__init__(reason)
        self.kind, self.reason = kind, reason


@dataclass(frozen=True)
class ModelShape:
    arch: str
    vocab: int
    hidden: int
    inter: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    tied: bool
    qkv_bias: bool
    o_bias: bool
    qk_norm: bool
    torch_dtype: str
    context_limit: int  # max_position_embeddings (stretched by dynamic RoPE)
    quantized_source: bool = False  # a GGUF file whose weights are all stored quantized
    int4_source: bool = False  # ... and its decoder linears in 4-bit groups of 32 (Q4_0/Q4_1/Q4_K)


def _pos_int(raw: dict, key: str, where: str) -> int:
    v = raw.get(key)
    if not isinstance(v, int) or isinstance(v, bool) or v <= 0:
        raise SizingError("invalid", f"{where}: field {key!r} must be a positive integer, got {v!r}")
    return v


def read_shape(path: str | Path) -> ModelShape:
    """Parse ``path/config.json``, or the metadata of a GGUF file (``path`` itself, or the one
    ``.gguf`` in the folder); raises ``SizingError``."""
    try:
        gguf_file = find_gguf(path)
        if gguf_file is not None:
            where = f"{gguf_file} (GGUF metadata)"
            return shape_from_config(hf_config(read_gguf(gguf_file)), where)
    except GGUFError as e:
        raise SizingError(e.kind, e.reason) from None
    cfg_path = Path(path) / "config.json"
    if not cfg_path.is_file():
        raise SizingError("not_found", f"{cfg_path}: no such file")
    try:
        raw = json.loads(cfg_path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise SizingError("invalid", f"{cfg_path}: not valid JSON ({e})") from None
    return shape_from_config(raw, str(cfg_path))


def shape_from_config(raw: dict, where: str) -> ModelShape:
    """Check a ``config.json`` dict; errors name ``where``."""
    if not isinstance(raw, dict):
        raise SizingError("invalid", f"{where}: not a JSON object")
    archs = raw.get("architectures") or []
    arch = next((a for a in archs if a in SUPPORTED_ARCHITECTURES), None) if isinstance(archs, list) else None
    if arch is None:
        raise SizingError(
            "unsupported",
            f"architecture {archs!r} is not supported (supported: {', '.join(SUPPORTED_ARCHITECTURES)})",
        )
    hidden = _pos_int(raw, "hidden_size", where)
    heads = _pos_int(raw, "num_attention_heads", where)
    kv_heads = raw.get("num_key_value_heads") or heads
    head_dim = raw.get("head_dim") or hidden // heads
    dtype = raw.get("torch_dtype") or raw.get("dtype") or "float32"
    if dtype not in _DTYPE_BYTES:
        raise SizingError("unsupported", f"{where}: torch_dtype {dtype!r} is not supported")
    limit = int(raw.get("max_position_embeddings") or 4096)
    rope = raw.get("rope_scaling") or raw.get("rope_parameters") or {}
    if isinstance(rope, dict) and (rope.get("rope_type") or rope.get("type")) == "dynamic":
        limit = int(limit * float(rope.get("factor", 1.0)))
    qwen2 = arch == "Qwen2ForCausalLM"
    bias = bool(raw.get("attention_bias", False))
    return ModelShape(
        arch=arch,
        vocab=_pos_int(raw, "vocab_size", where),
        hidden=hidden,
        inter=_pos_int(raw, "intermediate_size", where),
        layers=_pos_int(raw, "num_hidden_layers", where),
        heads=heads,
        kv_heads=int(kv_heads),
        head_dim=int(head_dim),
        tied=bool(raw.get("tie_word_embeddings", False)),
        qkv_bias=qwen2 or bias,
        o_bias=not qwen2 and bias,
        qk_norm=arch == "Qwen3ForCausalLM",
        torch_dtype=dtype,
        context_limit=limit,
        quantized_source=bool(raw.get("quantized_source", False)),
        int4_source=bool(raw.get("int4_source", False)),
    )


@dataclass(frozen=True)
class Estimate:
    """Bytes a model takes: ``base`` (embeddings, final norm, heads) lives on the first die,
    ``per_layer`` on the die that holds the layer; ``kv_per_token`` over all layers."""

    base: int
    per_layer: int
    layers: int
    kv_per_token: int
    context_limit: int

    @property
    def weights(self) -> int:
        return self.base + self.per_layer * self.layers

    def kv_pool(self, tokens: int) -> int:
        """The KV pool bytes that hold ``tokens`` tokens (whole blocks, at least two)."""
        blocks = max(2, -(-max(1, tokens) // BLOCK_TOKENS))
        return blocks * BLOCK_TOKENS * self.kv_per_token

    def kv_for(self, *, context: int, floor: int, room_tokens: int) -> int:
        """The KV pool bytes of a load: a full ``context`` when ``room_tokens`` (what the dies
        can give, already times the KV fraction) holds it, else what they hold in whole blocks,
        never less than ``floor`` tokens (a die without that much room then refuses the load).

        So the pool, and with it the per-request limit, is the model's context, unless memory
        says less; the admission floor (``--admit-ctx``) no longer caps a model that fits."""
        least = min(floor, context)
        tokens = max(least, min(context, room_tokens))
        return self.kv_pool(tokens)

    def split(
        self, dies: tuple[str, ...], weights: int | None = None, kv: int = 0
    ) -> dict[str, tuple[int, int]]:
        """``{die: (weight bytes, kv bytes)}`` for a replica whose layers are split across
        ``dies`` the way the loader splits them (contiguous near-equal runs; the embeddings and
        heads on the first die). ``weights`` (the worker's real figure) scales the estimate."""
        n = len(dies)
        counts = [0] * n
        for i in range(self.layers):
            counts[min(i * n // self.layers, n - 1)] += 1
        est = self.weights or 1
        scale = 1.0 if weights is None else weights / est
        out: dict[str, tuple[int, int]] = {}
        for j, die in enumerate(dies):
            w = (self.base if j == 0 else 0) + self.per_layer * counts[j]
            out[die] = (int(w * scale), int(kv * counts[j] / self.layers))
        if weights is not None:  # rounding: the first die takes what is left
            first = dies[0]
            out[first] = (weights - sum(v[0] for d, v in out.items() if d != first), out[first][1])
        if kv:
            first = dies[0]
            out[first] = (out[first][0], kv - sum(v[1] for d, v in out.items() if d != first))
        return out


# The CPU paths a worker can lay a model out in (``workers/cpu_paths.py`` runs them; this table is
# their torch-free description): name -> (compute dtype, layout, lossy). dense: plain weights;
# packed: oneDNN-prepacked, the same bytes, plus a packed copy of a tied LM head (the table stays
# for lookups); int8: weight-only int8 linears and head with one scale per output row (lossy: for
# loads that ask to quantize, and files stored quantized already); int4: the decoder's linears in
# 4-bit groups of 32 with a bf16 scale and zero each, the head in int8 rows (only for files whose
# linears are stored in 4-bit groups already: it gives their own levels back).
CPU_PATHS: dict[str, tuple[str, str, bool]] = {
    "bf16-packed": ("bfloat16", "packed", False),
    "bf16": ("bfloat16", "dense", False),
    "fp32-packed": ("float32", "packed", False),
    "fp32": ("float32", "dense", False),
    "int8": ("bfloat16", "int8", True),
    "int4": ("bfloat16", "int4", True),
}
INT4_GROUP = 32  # weights per scale and zero in the int4 layout


def int4_fits(n: int, k: int) -> bool:
    """Whether torch's int4 CPU kernel takes a [N, K] weight (N in 16s, K in whole groups); the
    int4 path keeps a matrix it does not take in int8 rows."""
    return n % 16 == 0 and k % INT4_GROUP == 0


def cpu_path_names(
    quantize: bool,
    dtype: str = "auto",
    works: dict[str, str] | None = None,
    quantized_source: bool = False,
    int4_source: bool = False,
) -> list[str]:
    """The CPU paths a load may end up on: only lossy ones when it asks to quantize, lossy ones
    too when the file is stored quantized already (int8 rows lose less than its 4-bit blocks
    did), int4 only when its linears are 4-bit groups already (``int4_source``), the load's
    ``dtype`` when one is asked for, and only those that probed well (``works``: a worker's
    Hello ``cpu_paths``; None: not known yet, so all of them)."""
    return [
        n
        for n, (dt, layout, lossy) in CPU_PATHS.items()
        if (lossy if quantize else (not lossy or quantized_source))
        and (layout != "int4" or int4_source)
        and (dtype == "auto" or dt == dtype)
        and (works is None or works.get(n) == "")
    ]


def dtype_bytes(dtype: str, shape: ModelShape) -> int:
    """Bytes per element of the weights and KV cache for a load's ``dtype`` ("auto": the
    checkpoint's own; float16 becomes bfloat16 on CPUs, the same size)."""
    name = shape.torch_dtype if dtype == "auto" else dtype
    return _DTYPE_BYTES.get(name, 2)


def estimate(
    shape: ModelShape,
    *,
    dtype: str = "auto",
    quantize: bool = False,
    cpu: bool = True,
    cpu_path: str | None = None,
    cpu_works: dict[str, str] | None = None,
) -> Estimate:
    """What the engine allocates for this model. On a CPU die that is the given ``cpu_path``'s
    layout; with none (the worker picks by timing at load) the largest of the paths it may pick
    (``cpu_path_names``), so the booking is an upper bound until ``Loaded`` gives the real one."""
    if cpu and cpu_path is None:
        q, q4 = shape.quantized_source, shape.int4_source
        names = cpu_path_names(quantize, dtype, cpu_works, q, q4) or cpu_path_names(
            quantize, dtype, None, q, q4
        )
        if not names:
            names = list(CPU_PATHS)
        ests = [estimate(shape, quantize=quantize, cpu_path=n) for n in names]
        return max(ests, key=lambda e: (e.weights, e.kv_per_token))
    layout = "int8" if quantize else "dense"
    if cpu:
        assert cpu_path is not None  # chosen above
        dtype, layout, _ = CPU_PATHS[cpu_path]
    b = dtype_bytes(dtype, shape)
    h, q, kv = shape.hidden, shape.heads * shape.head_dim, shape.kv_heads * shape.head_dim
    linear = h * (q + 2 * kv) + q * h + 3 * h * shape.inter  # qkv, o, gate+up, down
    rows = (q + 2 * kv) + h + 2 * shape.inter + h  # output rows of those matrices
    small = 2 * h  # the two RMSNorms
    small += (q + 2 * kv) if shape.qkv_bias else 0
    small += h if shape.o_bias else 0
    small += 2 * shape.head_dim if shape.qk_norm else 0
    if layout == "int8":  # a byte a weight, a scale a row
        linear_bytes = linear + rows * b
    elif layout == "int4":  # half a byte a weight and a scale and a zero a group, or int8 rows
        mats = [(q + 2 * kv, h), (h, q), (2 * shape.inter, h), (h, shape.inter)]  # [N, K], fused
        linear_bytes = sum(
            n * k // 2 + n * k // INT4_GROUP * 2 * b if int4_fits(n, k) else n * k + n * b for n, k in mats
        )
    else:
        linear_bytes = linear * b
    per_layer = linear_bytes + small * b
    table = shape.vocab * h * b
    # The LM head as the path lays it out (CPU paths only; CUDA's int8 keeps a plain head):
    # int8 rows plus a scale each (the int4 path's head too), else the table's bytes again.
    head_layout = layout if cpu else "dense"
    head = shape.vocab * (h + b) if head_layout in ("int8", "int4") else table
    base = table + h * b  # embeddings and the final norm
    if not shape.tied:
        base += head  # the LM head (laid out in place of the checkpoint's)
    elif head_layout != "dense":
        base += head  # the tied head's laid-out copy (the table stays for lookups)
    return Estimate(
        base=base,
        per_layer=per_layer,
        layers=shape.layers,
        kv_per_token=2 * shape.layers * kv * b,
        context_limit=shape.context_limit,
    )
