"""What the Ollama API says of a model: which models it lists (``served_models``, the one place
that decides it), and each one's details, ``model_info``, capabilities, size, digest and memory.

- ``details``: ``format`` (gguf / safetensors), ``family`` (the architecture), ``parameter_size``
  (Ollama's human form: ``135.07M``), ``quantization_level`` (a GGUF file's type, such as Q4_1;
  a Hugging Face folder's dtype, BF16 / F16 / F32; INT8 when loaded ``--quantize``);
- ``model_info``: a GGUF file's metadata as Ollama gives it (arrays of more than five items
  emptied, the name and chat template left out), else the same keys made from ``config.json``
  (``general.architecture``, ``<arch>.context_length``, ``.embedding_length``, ...);
- capabilities: ``completion``; ``tools`` when the model's chat template renders the tools it is
  given (``ChatTemplate.takes_tools``: Ollama's, a template that uses ``.Tools``; SmolLM2's does
  not: it gets our generic tool prompt, so tools still work through the API);
  ``thinking`` when it reasons in ``<think>`` blocks, Harmony's analysis channel or Gemma 4's
  thought channel; ``embedding`` when it serves ``/api/embed`` (a model that only embeds, BERT,
  has only that);
- size and ``modified_at``: the model's files on disk; ``digest``: a SHA-256 of where they are,
  their size and time, stable while the files do not change (Ollama's is its manifest's). No
  path is shown: a model's location is the admin API's to tell;
- ``/api/ps``: the bytes its instances booked on their dies (weights, KV cache, state),
  ``size_vram`` the part on CUDA dies (0 on CPU), ``context_length`` the per-request limit.

Reading a model's files (a GGUF header) is work for a thread; what it gives is kept per path
and modification time.
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pantheon.api.ollama.protocol import ModelDetails
from pantheon.api.state import AppState
from pantheon.control.context import limit_of
from pantheon.control.registry import Instance
from pantheon.core.description import ModelDescription, ModelError, read_description
from pantheon.core.embedding import served_embedding
from pantheon.core.gguf import GGUFError, find_gguf, read_gguf

LATEST = ":latest"  # Ollama's default tag: "tiny:latest" names "tiny"


@dataclass(frozen=True)
class Served:
    """A model the Ollama API lists: its name, its files, and its ready instances (empty: known
    but not loaded)."""

    name: str
    path: str
    instances: tuple[Instance, ...]


def served_models(s: AppState) -> list[Served]:
    """The models ``/api/tags`` lists and the Ollama routes know by name: the catalog's entries
    that can be served (loaded or not; ``pantheon.control.catalog``), then the ready models the
    admin API loaded that it does not list, one entry per name."""
    by_name: dict[str, list[Instance]] = {}
    for inst in s.registry.ready():
        by_name.setdefault(inst.name, []).append(inst)
    catalog = s.residency.catalog
    catalog.refresh()  # a model copied into a --models-dir folder shows at once
    out = [
        Served(e.name, e.path, tuple(by_name.pop(e.name, ()))) for e in catalog.entries() if e.error is None
    ]
    return out + [Served(name, insts[0].path, tuple(insts)) for name, insts in by_name.items()]


def find(s: AppState, name: str) -> Served | None:
    """The listed model ``name`` names: exactly, by a catalog alias, or with Ollama's
    ``:latest`` tag."""
    models = {m.name: m for m in served_models(s)}
    catalog = s.residency.catalog
    for n in (name, name[: -len(LATEST)] if name.endswith(LATEST) else None):
        if n is not None:
            hit = models.get(catalog.canonical(n) or n)
            if hit is not None:
                return hit
    return None


def resolve(s: AppState, name: str) -> str:
    """The name to route: a listed model's own for ``name`` (``x:latest`` -> ``x``), else
    ``name`` as it is (the registry answers it: a 404, or the only model)."""
    found = find(s, name)
    return found.name if found is not None else name


# ---------------------------------------------------------------- the files


# general.file_type (llama.cpp's llama_ftype) -> Ollama's name for it
FILE_TYPES = {
    0: "F32",
    1: "F16",
    2: "Q4_0",
    3: "Q4_1",
    7: "Q8_0",
    8: "Q5_0",
    9: "Q5_1",
    10: "Q2_K",
    11: "Q3_K_S",
    12: "Q3_K_M",
    13: "Q3_K_L",
    14: "Q4_K_S",
    15: "Q4_K_M",
    16: "Q5_K_S",
    17: "Q5_K_M",
    18: "Q6_K",
    32: "BF16",
}
DTYPES = {"bfloat16": "BF16", "float16": "F16", "float32": "F32"}
_DROPPED_KEYS = ("general.name", "tokenizer.chat_template")
MAX_ARRAY = 5  # Ollama's /api/show empties longer arrays (vocabularies) unless verbose


@dataclass(frozen=True)
class Files:
    format: str  # gguf | safetensors
    size: int
    modified: float  # unix time of the newest file
    digest: str
    quantization: str  # a GGUF file's type; "" for a Hugging Face folder
    parameters: int  # a GGUF file's element count; 0: count from the description
    gguf_info: dict[str, Any] | None  # a GGUF file's metadata, as /api/show gives it


def files_of(path: str) -> Files:
    """The facts of the model files at ``path`` (blocking: call it in a thread)."""
    try:
        stamp = os.stat(path).st_mtime_ns
    except OSError:
        stamp = 0
    return _files(path, stamp)


@functools.lru_cache(maxsize=64)
def _files(path: str, stamp: int) -> Files:
    p = Path(path)
    try:
        gguf = find_gguf(p)
    except GGUFError:
        gguf = None
    if gguf is not None:
        files = [gguf]
    elif p.is_dir():
        files = sorted(f for f in p.iterdir() if f.is_file())
    else:
        files = [p]
    stats = [f.stat() for f in files if f.exists()]
    size = sum(st.st_size for st in stats)
    newest = max((st.st_mtime_ns for st in stats), default=stamp)
    where = os.path.realpath(path)
    digest = hashlib.sha256(f"{where}\0{size}\0{newest}".encode()).hexdigest()
    quant, count, info = "", 0, None
    if gguf is not None:
        try:
            g = read_gguf(gguf)
        except (GGUFError, OSError):
            g = None
        if g is not None:
            quant = _file_type(g.meta.get("general.file_type"), [t.type_name for t in g.tensors.values()])
            count = sum(_elements(t.shape) for t in g.tensors.values())
            info = {
                k: ([] if isinstance(v, list) and len(v) > MAX_ARRAY else v)
                for k, v in g.meta.items()
                if k not in _DROPPED_KEYS
            }
    return Files(
        "gguf" if gguf is not None else "safetensors", size, newest / 1e9, digest, quant, count, info
    )


def _elements(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def _file_type(code: object, tensor_types: list[str]) -> str:
    """``general.file_type``'s name; without one, the commonest tensor type."""
    if isinstance(code, int) and code in FILE_TYPES:
        return FILE_TYPES[code]
    if not tensor_types:
        return ""
    return max(set(tensor_types), key=tensor_types.count)


# ---------------------------------------------------------------- what is said of a model


def shape_of(served: Served) -> ModelDescription | None:
    """The model's description: its instance's, else read from its files (blocking)."""
    for inst in served.instances:
        if isinstance(inst.shape, ModelDescription):
            return inst.shape
    try:
        return read_description(served.path)
    except ModelError:
        return None


def parameter_count(shape: ModelDescription) -> int:
    """The model's parameters, counted from its description (embeddings, each layer's matrices
    and small tensors, the final norm, an untied head)."""
    n = sum(r * c for layer in shape.layers for r, c in layer.linears)
    n += sum(layer.small for layer in shape.layers)
    n += shape.vocab_size * shape.hidden_size * (1 if shape.tie_word_embeddings else 2)
    return n + shape.hidden_size


def human_number(n: int) -> str:
    """Ollama's ``format.HumanNumber``: 7B, 7.2B, 135M, 135.07M, 12K."""
    for unit, size, places in (("B", 1e9, 1), ("M", 1e6, 2)):
        if n >= size:
            x = n / size
            return f"{x:.0f}{unit}" if x == int(x) else f"{x:.{places}f}{unit}"
    return f"{n / 1e3:.0f}K" if n >= 1000 else str(n)


def details(served: Served, files: Files, shape: ModelDescription | None) -> ModelDetails:
    family = ""
    if files.gguf_info is not None:
        family = str(files.gguf_info.get("general.architecture", ""))
    if not family and shape is not None:
        family = shape.arch
    quant = files.quantization
    if not quant:
        quantized = any(i.quantize for i in served.instances)
        quant = "INT8" if quantized else DTYPES.get(shape.torch_dtype, "") if shape is not None else ""
    count = files.parameters or (parameter_count(shape) if shape is not None else 0)
    return ModelDetails(
        format=files.format,
        family=family,
        families=[family] if family else [],
        parameter_size=human_number(count) if count else "",
        quantization_level=quant,
    )


def model_info(files: Files, shape: ModelDescription | None) -> dict[str, object]:
    """Ollama's ``model_info`` (see the module doc)."""
    count = files.parameters or (parameter_count(shape) if shape is not None else 0)
    if files.gguf_info is not None:
        info = dict(files.gguf_info)
        if count:
            info.setdefault("general.parameter_count", count)
        return info
    if shape is None:
        return {}
    a = shape.arch
    return {
        "general.architecture": a,
        "general.parameter_count": count,
        f"{a}.context_length": shape.context_limit,
        f"{a}.embedding_length": shape.hidden_size,
        f"{a}.block_count": shape.num_layers,
        f"{a}.feed_forward_length": shape.intermediate_size,
        f"{a}.attention.head_count": shape.num_heads,
        f"{a}.attention.head_count_kv": shape.num_kv_heads,
        f"{a}.attention.key_length": shape.head_dim,
        f"{a}.attention.value_length": shape.head_dim,
        f"{a}.attention.layer_norm_rms_epsilon": shape.rms_norm_eps,
        f"{a}.rope.freq_base": shape.rope.theta,
        f"{a}.vocab_size": shape.vocab_size,
    }


def capabilities(served: Served) -> list[str]:
    """What the model's chat template supports (a model not loaded: ``completion`` only)."""
    assets = next((i.assets for i in served.instances if i.assets is not None), None)
    inst = served.instances[0] if served.instances else None
    embeds = (
        inst is not None
        and served_embedding(getattr(inst.shape, "embedding", None), inst.embeddings) is not None
    )
    if inst is not None and not getattr(inst.shape, "can_generate", True):
        return ["embedding"]
    caps = ["completion"] + (["embedding"] if embeds else [])
    if assets is not None and assets.template.takes_tools:
        caps.append("tools")
    if assets is not None and getattr(assets, "reasoning", False):
        caps.append("thinking")
    return caps


def template(served: Served) -> str:
    """The chat template's source (Jinja; empty when the model has none and ChatML is used)."""
    for inst in served.instances:
        if inst.assets is not None:
            t = inst.assets.template
            return t.source or t.tool_use_source or ""
    return ""


def parameters(served: Served) -> str:
    """The model's generation defaults as a Modelfile's ``PARAMETER`` lines would say them."""
    params = served.instances[0].params if served.instances else {}
    return "\n".join(f"{k:<30} {json.dumps(v)}" for k, v in params.items())


def modelfile(served: Served) -> str:
    out = f"# Modelfile generated by pantheon (its models come from --model, --models-dir or the config file)\nFROM {served.name}\n"
    tmpl = template(served)
    if tmpl:
        out += f'TEMPLATE """{tmpl}"""\n'
    params = served.instances[0].params if served.instances else {}
    return out + "".join(f"PARAMETER {k} {json.dumps(v)}\n" for k, v in params.items())


def memory(s: AppState, served: Served) -> tuple[int, int]:
    """(bytes, bytes on CUDA dies) its instances booked: weights, KV cache, state."""
    ids = {i.instance_id for i in served.instances}
    total = vram = 0
    for die in s.dies.dies():
        for iid, booked in die.bookings.items():
            if iid in ids:
                total += sum(booked)
                vram += sum(booked) if die.kind == "cuda" else 0
    if not total:  # no booking seen (yet): the workers' own figures
        for i in served.instances:
            loaded = i.loaded
            if loaded is not None:
                total += loaded.weight_bytes + loaded.kv_bytes + getattr(loaded, "state_bytes", 0)
    return total, vram


def context_length(served: Served) -> int:
    return max((limit_of(i) for i in served.instances), default=0)
