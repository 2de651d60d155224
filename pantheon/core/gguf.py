"""GGUF files as model sources: find them, read their header, and turn the metadata into what a
Hugging Face folder would hold (``config.json``, ``tokenizer.json``, the chat template).

Shared by the router (sizing, tokenizer, template) and the worker (config; ``workers/gguf_weights``
reads the tensors). No torch here. The header is parsed by this module (a GGUF v2/v3 file:
magic, version, counts, the metadata key/values, the tensor infos, then the aligned data), straight
from a memory map with ``struct``: ``gguf.GGUFReader`` builds a numpy view per array element and
takes seconds on a 49k-token vocabulary, which a load pays twice in the router and twice in the
worker. The ``gguf`` package is imported lazily, only to name a tensor type we do not read.

The vocabulary's translation into a ``tokenizers`` JSON is ``pantheon.core.gguf_tokenizer``.

Tensor shapes here are in torch order (GGUF lists ``ne[0]``, the contiguous dimension, first).
Every error is a ``GGUFError(kind, reason)``, kind not_found | unsupported | invalid, and the
reason names the file and the field or tensor.
"""

from __future__ import annotations

import math
import mmap
import os
import re
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

GGUF_MAGIC = b"GGUF"
DEFAULT_ALIGNMENT = 32


# The tensor types the worker dequantizes: ggml type id -> (name, elements per block, bytes per
# block). ``workers/gguf_weights.py`` has one function per entry.
TENSOR_TYPES: dict[int, tuple[str, int, int]] = {
    0: ("F32", 1, 4),
    1: ("F16", 1, 2),
    2: ("Q4_0", 32, 18),
    3: ("Q4_1", 32, 20),
    6: ("Q5_0", 32, 22),
    7: ("Q5_1", 32, 24),
    8: ("Q8_0", 32, 34),
    10: ("Q2_K", 256, 84),
    11: ("Q3_K", 256, 110),
    12: ("Q4_K", 256, 144),
    13: ("Q5_K", 256, 176),
    14: ("Q6_K", 256, 210),
    30: ("BF16", 1, 2),
    39: ("MXFP4", 32, 17),
}
SUPPORTED_TYPES = ", ".join(name for name, _, _ in TENSOR_TYPES.values())

# llama.cpp's token types (tokenizer.ggml.token_type)
TOKEN_NORMAL, TOKEN_UNKNOWN, TOKEN_CONTROL, TOKEN_USER_DEFINED, TOKEN_UNUSED, TOKEN_BYTE = range(1, 7)

# Metadata value types: id -> (struct format, size) for the fixed-size ones.
_SCALARS = {
    0: ("B", 1),
    1: ("b", 1),
    2: ("H", 2),
    3: ("h", 2),
    4: ("I", 4),
    5: ("i", 4),
    6: ("f", 4),
    7: ("?", 1),
    10: ("Q", 8),
    11: ("q", 8),
    12: ("d", 8),
}
_STRING, _ARRAY = 8, 9


class GGUFError(Exception):
    """A GGUF file (or folder) that cannot be used. ``kind``: not_found | unsupported | invalid."""

    def __init__(self, kind: str, reason: str):
        super().__init__(reason)
        self.kind, self.reason = kind, reason


@dataclass(frozen=True)
class GGUFTensor:
    name: str
    type: int  # ggml type id (a key of TENSOR_TYPES)
    type_name: str
    shape: tuple[int, ...]  # torch order: the GGUF dimensions reversed
    offset: int  # absolute byte offset of the data in the file
    nbytes: int


@dataclass(frozen=True)
class GGUFFile:
    """A parsed GGUF header: ``meta`` (key -> str | int | float | bool | list) and ``tensors``
    (name -> GGUFTensor, in file order)."""

    path: Path
    version: int
    meta: dict[str, Any]
    tensors: dict[str, GGUFTensor]

    @property
    def arch(self) -> str:
        return str(self.meta.get("general.architecture", ""))


# ---------------------------------------------------------------- finding the file


def find_gguf(path: str | Path) -> Path | None:
    """The GGUF file ``path`` names: itself when it is a ``.gguf`` file, the only ``*.gguf`` in a
    folder without a ``config.json``; None for anything else (a Hugging Face folder, a missing
    path). A folder with several ``.gguf`` files is an error naming them."""
    p = Path(path)
    if p.is_file():
        return p if p.suffix.lower() == ".gguf" else None
    if not p.is_dir() or (p / "config.json").is_file():
        return None
    found = sorted(f for f in p.iterdir() if f.suffix.lower() == ".gguf" and f.is_file())
    if len(found) > 1:
        names = ", ".join(f.name for f in found)
        raise GGUFError(
            "invalid", f"{p}: holds several .gguf files ({names}); give the path of the one to load"
        )
    return found[0] if found else None


_QUANT_TAG = re.compile(r"[._-](?:i?q\d+(?:_[a-z0-9]+)*|bf16|f16|fp16|f32|fp32|f64)$", re.IGNORECASE)


def served_name(path: str | Path) -> str:
    """The default served name of a model path: a ``.gguf`` file's stem lower-cased, without a
    trailing quantization tag (``SmolLM2-135M-Instruct.Q4_1.gguf`` -> ``smollm2-135m-instruct``);
    a folder's name otherwise."""
    base = os.path.basename(os.path.normpath(str(path)))
    if base.lower().endswith(".gguf") and not os.path.isdir(path):
        stem = base[:-5]
        while (cut := _QUANT_TAG.sub("", stem)) != stem and cut:
            stem = cut
        return stem.lower() or "model"
    return base or "model"


# ---------------------------------------------------------------- the header


class _Cursor:
    """Reads little-endian values off a memory map, with bounds checks that name the item."""

    def __init__(self, buf, path: Path):
        self.buf, self.path, self.pos, self.size = buf, path, 0, len(buf)
        self.what = "the header"

    def need(self, n: int) -> None:
        if n < 0 or self.pos + n > self.size:
            raise GGUFError(
                "invalid",
                f"{self.path}: truncated GGUF file: {self.what} runs past "
                f"the end of the file ({self.size} bytes)",
            )

    def unpack(self, fmt: str, size: int):
        self.need(size)
        v = struct.unpack_from("<" + fmt, self.buf, self.pos)[0]
        self.pos += size
        return v

    def string(self) -> str:
        n = self.unpack("Q", 8)
        self.need(n)
        raw = self.buf[self.pos : self.pos + n]
        self.pos += n
        return raw.decode("utf-8", errors="replace")

    def strings(self, count: int) -> list[str]:
        """``count`` strings in a row (a vocabulary's tokens, its merges: 250k of them in
        Qwen3.5's files), as ``string`` reads them, in one loop without its calls (0.53 -> 0.12 s
        a Qwen3.5 file's header on a 2-core Zen 5)."""
        buf, pos, size, length = self.buf, self.pos, self.size, _LENGTH.unpack_from
        out = []
        for _ in range(count):
            if pos + 8 > size:
                break
            (n,) = length(buf, pos)
            pos += 8
            if pos + n > size:
                break
            out.append(buf[pos : pos + n].decode("utf-8", errors="replace"))
            pos += n
        self.pos = pos
        if len(out) < count:  # past the end: the error string() gives
            self.string()
        return out

    def value(self, vtype: int):
        if vtype in _SCALARS:
            return self.unpack(*_SCALARS[vtype])
        if vtype == _STRING:
            return self.string()
        if vtype == _ARRAY:
            itype = self.unpack("I", 4)
            count = self.unpack("Q", 8)
            if itype in _SCALARS:
                fmt, size = _SCALARS[itype]
                self.need(count * size)
                out = list(struct.unpack_from(f"<{count}{fmt}", self.buf, self.pos))
                self.pos += count * size
                return out
            if itype == _STRING:
                self.need(count * 8)  # at least the lengths
                return self.strings(count)
            if itype == _ARRAY:
                self.need(count * 12)
                return [self.value(_ARRAY) for _ in range(count)]
            raise GGUFError("invalid", f"{self.path}: {self.what} is an array of unknown value type {itype}")
        raise GGUFError("invalid", f"{self.path}: {self.what} has unknown value type {vtype}")


_LENGTH = struct.Struct("<Q")  # a string's length


def _type_name(type_id: int) -> str:
    if type_id in TENSOR_TYPES:
        return TENSOR_TYPES[type_id][0]
    try:
        from gguf import GGMLQuantizationType

        return GGMLQuantizationType(type_id).name
    except (ImportError, ValueError):
        return f"type {type_id}"


def read_gguf(path: str | Path) -> GGUFFile:
    """Parse a GGUF file's header and check every tensor's type, size and bounds; raises
    ``GGUFError``. The tensor data is not read (``workers/gguf_weights`` maps it)."""
    path = Path(path)
    try:
        f = open(path, "rb")
    except FileNotFoundError:
        raise GGUFError("not_found", f"{path}: no such file") from None
    except OSError as e:
        raise GGUFError("invalid", f"{path}: cannot open ({e.strerror})") from None
    with f:
        size = path.stat().st_size
        if size < 24:
            raise GGUFError("invalid", f"{path}: truncated GGUF file ({size} bytes, no header)")
        with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as buf:
            return _parse(buf, path, size)


def _parse(buf, path: Path, size: int) -> GGUFFile:
    cur = _Cursor(buf, path)
    if buf[:4] != GGUF_MAGIC:
        raise GGUFError("invalid", f"{path}: not a GGUF file (magic {bytes(buf[:4])!r})")
    cur.pos = 4
    version = cur.unpack("I", 4)
    if version & 0xFFFF == 0 and version:
        raise GGUFError("unsupported", f"{path}: big-endian GGUF files are not supported")
    if version not in (2, 3):
        raise GGUFError("unsupported", f"{path}: GGUF version {version} is not supported (supported: 2, 3)")
    n_tensors, n_kv = cur.unpack("Q", 8), cur.unpack("Q", 8)
    meta: dict[str, Any] = {}
    for i in range(n_kv):
        cur.what = f"metadata entry #{i}"
        key = cur.string()
        cur.what = f"metadata field {key!r}"
        meta[key] = cur.value(cur.unpack("I", 4))
    infos = []
    for i in range(n_tensors):
        cur.what = f"tensor info #{i}"
        name = cur.string()
        cur.what = f"tensor info of {name!r}"
        n_dims = cur.unpack("I", 4)
        if n_dims > 8:
            raise GGUFError("invalid", f"{path}: tensor {name!r} has {n_dims} dimensions")
        dims = [cur.unpack("Q", 8) for _ in range(n_dims)]
        infos.append((name, dims, cur.unpack("I", 4), cur.unpack("Q", 8)))
    align = meta.get("general.alignment", DEFAULT_ALIGNMENT)
    if not isinstance(align, int) or align <= 0 or align & (align - 1):
        raise GGUFError(
            "invalid", f"{path}: metadata field 'general.alignment' must be a power of two, got {align!r}"
        )
    data_start = -(-cur.pos // align) * align
    tensors: dict[str, GGUFTensor] = {}
    for name, dims, type_id, offset in infos:
        if name in tensors:
            raise GGUFError("invalid", f"{path}: tensor {name!r} is listed twice")
        if type_id not in TENSOR_TYPES:
            raise GGUFError(
                "unsupported",
                f"{path}: tensor {name!r} has type "
                f"{_type_name(type_id)}, which is not supported "
                f"(supported: {SUPPORTED_TYPES})",
            )
        tname, block, block_bytes = TENSOR_TYPES[type_id]
        numel = 1
        for d in dims:
            numel *= d
        if dims and dims[0] % block:
            raise GGUFError(
                "invalid",
                f"{path}: tensor {name!r} ({tname}) has rows of "
                f"{dims[0]} values, not a multiple of its block of {block}",
            )
        nbytes = numel // block * block_bytes
        start = data_start + offset
        if offset % align:
            raise GGUFError("invalid", f"{path}: tensor {name!r} is not aligned to {align} bytes")
        if start + nbytes > size:
            raise GGUFError(
                "invalid",
                f"{path}: truncated GGUF file: tensor {name!r} ends at "
                f"byte {start + nbytes} but the file has {size}",
            )
        tensors[name] = GGUFTensor(name, type_id, tname, tuple(reversed(dims)), start, nbytes)
    return GGUFFile(path=path, version=version, meta=meta, tensors=tensors)


# ---------------------------------------------------------------- config.json


def _field(g: GGUFFile, key: str, kind: type = int, default: Any = ...) -> Any:
    if key not in g.meta:
        if default is not ...:
            return default
        raise GGUFError("invalid", f"{g.path}: missing metadata field {key!r}")
    v = g.meta[key]
    ok = (
        (isinstance(v, (int, float)) and not isinstance(v, bool))
        if kind is float
        else (isinstance(v, kind) and not (kind is int and isinstance(v, bool)))
    )
    if not ok or (kind is int and v <= 0):
        want = {int: "a positive integer", float: "a number", str: "a string"}.get(kind, kind)
        raise GGUFError("invalid", f"{g.path}: metadata field {key!r} must be {want}, got {v!r}")
    return v


def _per_layer(g: GGUFFile, key: str, default: Any = ..., *, first: bool = False) -> int:
    """A count that a file may also give per layer (a list): ours must all be the same, unless
    ``first`` (the family reads the list itself): then the first layer's."""
    v = g.meta.get(key)
    if not isinstance(v, list):
        return _field(g, key, default=default)
    if not v:
        raise GGUFError("invalid", f"{g.path}: metadata field {key!r} is an empty list")
    if len(set(v)) != 1 and not first:
        raise GGUFError(
            "unsupported", f"{g.path}: metadata field {key!r} varies per layer ({sorted(set(v))})"
        )
    if not isinstance(v[0], int) or isinstance(v[0], bool) or v[0] <= 0:
        raise GGUFError(
            "invalid", f"{g.path}: metadata field {key!r} must be a positive integer, got {v[0]!r}"
        )
    return v[0]


def _rope_scaling(g: GGUFFile, a: str) -> dict | None:
    kind = g.meta.get(f"{a}.rope.scaling.type")
    factor = g.meta.get(f"{a}.rope.scaling.factor")
    if kind is None and isinstance(g.meta.get(f"{a}.rope.scale_linear"), (int, float)):
        kind, factor = "linear", g.meta[f"{a}.rope.scale_linear"]
    if kind in (None, "none"):
        return None
    if kind not in ("linear", "yarn"):
        raise GGUFError(
            "unsupported",
            f"{g.path}: metadata field '{a}.rope.scaling.type' is {kind!r}; supported: none, linear, yarn",
        )
    if not isinstance(factor, (int, float)) or isinstance(factor, bool):
        raise GGUFError("invalid", f"{g.path}: missing metadata field '{a}.rope.scaling.factor'")
    out: dict[str, Any] = {"rope_type": kind, "factor": float(factor)}
    orig = g.meta.get(f"{a}.rope.scaling.original_context_length")
    if isinstance(orig, int) and orig > 0:
        out["original_max_position_embeddings"] = orig
    for src, dst in (("yarn_beta_fast", "beta_fast"), ("yarn_beta_slow", "beta_slow")):
        v = g.meta.get(f"{a}.rope.scaling.{src}")
        if isinstance(v, (int, float)) and v:
            out[dst] = float(v)
    return out


def token_id(g: GGUFFile, key: str) -> int | None:
    v = g.meta.get(f"tokenizer.ggml.{key}")
    return v if isinstance(v, int) and not isinstance(v, bool) and v >= 0 else None


def eos_token_ids(g: GGUFFile) -> list[int]:
    """The end-of-generation ids: eos, then eot and eom when the file names them."""
    ids = [token_id(g, k) for k in ("eos_token_id", "eot_token_id", "eom_token_id")]
    return list(dict.fromkeys(i for i in ids if i is not None))


FLOAT_TYPES = ("F32", "F16", "BF16")
FOUR_BIT_TYPES = ("Q4_0", "Q4_1", "Q4_K")  # 4-bit affine groups of 32: the int4 layout's own levels


def _block_row_bytes(t: GGUFTensor | None) -> int:
    """The bytes a row of matrix ``t`` takes when it is stored in a block type whose blocks its
    rows hold whole (a quantized token table); 0 for a float one (or none)."""
    if t is None or len(t.shape) != 2 or t.type not in TENSOR_TYPES:
        return 0
    _name, block, nbytes = TENSOR_TYPES[t.type]
    return 0 if block == 1 or t.shape[1] % block else t.shape[1] // block * nbytes


def storage(tensors: dict[str, GGUFTensor]) -> tuple[str, bool, bool]:
    """How a file stores its matrices: (torch_dtype of its float ones, stored quantized, mostly in
    4-bit groups). The matrices: tensors of 2 or 3 dimensions (a mixture of experts' stacks) whose
    rows hold at least one quantization block, less what every quantizer keeps in float and a
    CPU die keeps as it is: a depthwise convolution's [C, 4] taps (Qwen3.5's ssm_conv1d, short
    rows), a mixture of experts' router (``ffn_gate_inp``, F32 in llama-quantize's files) and
    MXFP4 experts (held as they ship on every path). Stored quantized: no float matrix left
    (a CPU die may then keep its linears in int8 rows, which costs less accuracy than the file's
    own quantization already did: workers/cpu_paths). Mostly 4-bit: at least half the decoder's
    matrix weights in Q4_0 / Q4_1 / Q4_K (a Q4_K_M file keeps some in Q6_K / Q5_K), the experts
    counted: the int4 layout then holds their own levels, the others int8 rows."""
    mats = [
        (name, t.type_name, math.prod(t.shape))
        for name, t in tensors.items()
        if len(t.shape) in (2, 3)
        and t.shape[-1] >= 32
        and t.type_name != "MXFP4"
        and ".ffn_gate_inp" not in name
    ]
    kinds = [kind for _, kind, _ in mats]
    dtype = (
        "float32"
        if kinds and all(k == "F32" for k in kinds)
        else "float16"
        if kinds and all(k == "F16" for k in kinds)
        else "bfloat16"
    )
    quantized = bool(kinds) and not any(k in FLOAT_TYPES for k in kinds)
    blk = [(kind, n) for name, kind, n in mats if name.startswith("blk.")]
    four = sum(n for kind, n in blk if kind in FOUR_BIT_TYPES)
    return dtype, quantized, quantized and bool(blk) and 2 * four >= sum(n for _, n in blk)


def hf_config(g: GGUFFile) -> dict:
    """The ``config.json`` a Hugging Face folder of this model would have (checked by the same
    code as a real one: ``workers.model_config.config_from_dict``, ``pantheon.core.sizing``)."""
    from pantheon.core import archs  # the families import this module's types

    a = g.arch
    family = archs.gguf_family(a)
    if family is None:
        raise GGUFError(
            "unsupported",
            f"{g.path}: metadata field 'general.architecture' is "
            f"{a!r}; supported: {', '.join(archs.gguf_architectures())}",
        )
    split = g.meta.get("split.count")
    if isinstance(split, int) and split > 1:
        raise GGUFError(
            "unsupported", f"{g.path}: split GGUF files ({split} parts) are not supported; merge them first"
        )
    own = family.gguf_own
    if "rope_freqs.weight" in g.tensors and "rope_freqs.weight" not in own:
        raise GGUFError(
            "unsupported",
            f"{g.path}: tensor 'rope_freqs.weight' (per-dimension RoPE "
            "frequency factors, as Llama 3.1 files carry) is not "
            "supported",
        )
    hidden = _field(g, f"{a}.embedding_length")
    heads = _per_layer(g, f"{a}.attention.head_count")
    kv_heads = _per_layer(
        g, f"{a}.attention.head_count_kv", default=heads, first="attention.head_count_kv" in own
    )
    head_dim = _field(g, f"{a}.attention.key_length", default=hidden // heads)
    value_dim = _field(g, f"{a}.attention.value_length", default=head_dim)
    if value_dim != head_dim:
        raise GGUFError(
            "unsupported",
            f"{g.path}: metadata field '{a}.attention.value_length' "
            f"({value_dim}) differs from '{a}.attention.key_length' "
            f"({head_dim})",
        )
    rot = _field(g, f"{a}.rope.dimension_count", default=head_dim)
    emb = g.tensors.get("token_embd.weight")
    tokens = g.meta.get("tokenizer.ggml.tokens")
    if emb is not None and len(emb.shape) == 2:
        vocab = emb.shape[0]
    elif isinstance(tokens, list) and tokens:
        vocab = len(tokens)
    else:
        vocab = _field(g, f"{a}.vocab_size")
    dtype, quantized, int4 = storage(g.tensors)
    bias = "blk.0.attn_q.bias" in g.tensors
    eos = eos_token_ids(g)
    arch_name, model_type = family.gguf_architectures[a]
    ffn = f"{a}.feed_forward_length"
    if ffn not in g.meta and f"{a}.expert_feed_forward_length" in g.meta:
        ffn = f"{a}.expert_feed_forward_length"  # experts and no dense MLP (qwen35moe): the family sizes it
    raw = {
        "architectures": [arch_name],
        "model_type": model_type,
        "hidden_size": hidden,
        "intermediate_size": _per_layer(g, ffn, first=ffn.split(".", 1)[1] in own),
        "num_hidden_layers": _field(g, f"{a}.block_count"),
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
        "head_dim": head_dim,
        "rms_norm_eps": float(_field(g, f"{a}.attention.layer_norm_rms_epsilon", float, 1e-6)),
        "rope_theta": float(_field(g, f"{a}.rope.freq_base", float, 10000.0)),
        "rope_scaling": _rope_scaling(g, a),
        "max_position_embeddings": _field(g, f"{a}.context_length", default=4096),
        "vocab_size": vocab,
        "tie_word_embeddings": "output.weight" not in g.tensors,
        "attention_bias": bias and a != "qwen2",
        "torch_dtype": dtype,
        "quantized_source": quantized,  # ours, not transformers': see above
        "int4_source": int4,  # likewise
        "table_row_bytes": _block_row_bytes(emb),  # likewise
        "bos_token_id": token_id(g, "bos_token_id"),
        "eos_token_id": eos[0] if len(eos) == 1 else (eos or None),
    }
    if rot != head_dim:
        raw["partial_rotary_factor"] = rot / head_dim
    if family.gguf_config is not None:
        family.gguf_config(g, raw)  # the family's own fields
    return raw


def read_f32(g: GGUFFile, name: str) -> list[float]:
    """A small F32 tensor's values (``rope_freqs.weight``: the family's config reads them)."""
    t = g.tensors.get(name)
    if t is None:
        raise GGUFError("invalid", f"{g.path}: missing tensor {name!r}")
    if t.type_name != "F32":
        raise GGUFError("unsupported", f"{g.path}: tensor {name!r} is {t.type_name}, not F32")
    with open(g.path, "rb") as f:
        f.seek(t.offset)
        raw = f.read(t.nbytes)
    if len(raw) != t.nbytes:
        raise GGUFError("invalid", f"{g.path}: truncated GGUF file: tensor {name!r}")
    return list(struct.unpack(f"<{t.nbytes // 4}f", raw))


# ---------------------------------------------------------------- tokenizer.json


def byte_alphabet() -> dict[int, str]:
    """GPT-2's byte -> printable character table (the ByteLevel pre-tokenizer's alphabet)."""
    bs = (
        list(range(ord("!"), ord("~") + 1))
        + list(range(ord("¡"), ord("¬") + 1))
        + list(range(ord("®"), ord("ÿ") + 1))
    )
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {b: chr(c) for b, c in zip(bs, cs)}


# ---------------------------------------------------------------- chat template


def chat_template(g: GGUFFile, name: str | None = None) -> str | None:
    """``tokenizer.chat_template`` (or the named one, ``tokenizer.chat_template.NAME``)."""
    v = g.meta.get("tokenizer.chat_template" + (f".{name}" if name else ""))
    return v if isinstance(v, str) and v else None


def special_tokens(g: GGUFFile) -> dict[str, str]:
    """``bos_token``, ``eos_token``, ``unk_token``, ``pad_token`` as strings, those the file names."""
    tokens = g.meta.get("tokenizer.ggml.tokens")
    out: dict[str, str] = {}
    if not isinstance(tokens, list):
        return out
    for name, key in (
        ("bos_token", "bos_token_id"),
        ("eos_token", "eos_token_id"),
        ("unk_token", "unknown_token_id"),
        ("pad_token", "padding_token_id"),
    ):
        tid = token_id(g, key)
        if tid is not None and tid < len(tokens):
            out[name] = tokens[tid]
    return out
