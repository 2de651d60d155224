"""Build a model (its family's ``workers/models/<family>.py``) on the meta device and fill it straight from safetensors or GGUF files.

The model is created without storage (``torch.device("meta")``), then each parameter gets
uninitialised storage on its die and every checkpoint tensor is copied into place from the
memory-mapped file, so the weights exist once in memory (plus the page cache). Fused
parameters (qkv, gate_up) are filled slice by slice. Both sources share the filling (names,
shape check, progress, missing tensors, the tied head); a GGUF's tensors are dequantized one at
a time by ``workers.gguf_weights``, a quantized one straight into its parameter where it can be
(``workers.gguf_blocks.Unpacked``). A caller may lay each decoder layer out as soon as it is
whole (``on_layer``), hold a GGUF's quantized token table as its blocks (``embed_blocks``), and
have a mixture of experts' experts quantized as their pieces arrive (``experts``).
safetensors or GGUF only: never pickle.
"""

from __future__ import annotations

import json
import struct
from collections.abc import Callable, Container, Iterator
from functools import partial
from pathlib import Path

import numpy as np
import torch
from safetensors import safe_open
from torch import nn
from torch.overrides import TorchFunctionMode

from pantheon.core.gguf import GGUFFile, find_gguf, read_gguf
from workers.errors import LoadError
from workers.gguf_blocks import Unpacked
from workers.gguf_weights import iter_tensors, table_blocks
from workers.layers.block_embedding import BlockEmbedding
from workers.layers.moe import MoE
from workers.model_config import ModelConfig, gguf_config, gguf_errors, load_config
from workers.models import Family, Target, family, is_stacked, joined_part, joined_pieces, unstacked
from workers.models.base import DecoderLM
from workers.quant import QuantExperts

_COPY_VALUES = 1 << 14  # values per copy into a parameter (see _fill)
DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}
_ST_DTYPE_BYTES = {
    "BF16": 2,
    "F16": 2,
    "F32": 4,
    "F64": 8,
    "I64": 8,
    "I32": 4,
    "I16": 2,
    "I8": 1,
    "U8": 1,
    "BOOL": 1,
}


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
        found = sorted(p.name for p in model_dir.glob("*.bin")) + sorted(
            p.name for p in model_dir.glob("*.pt*")
        )
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
                "invalid",
                f"{path}: truncated safetensors file: tensor {name!r} ends at byte "
                f"{end} but the data section has {data_len}",
            )
        if nbytes and end - start != numel * nbytes:
            raise LoadError(
                "invalid", f"{path}: corrupt safetensors entry for tensor {name!r} (size mismatch)"
            )
    return header


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
    model_path: str | Path,
    devices: list[str] | None = None,
    dtype: str = "auto",
    progress: Callable[[int, int], None] | None = None,
    cfg: ModelConfig | None = None,
    on_layer: Callable[[int, nn.Module], None] | None = None,
    embed_blocks: bool = False,
    experts: str | None = None,
    gguf: GGUFFile | None = None,
) -> tuple[DecoderLM, ModelConfig]:
    """Load a Hugging Face model folder, a GGUF file or a folder holding one onto ``devices``
    (layers split across several). ``cfg``: the model's description when the caller has read it
    already (the engine does, before any weight is touched), so it is parsed once per load.
    ``on_layer(i, layer)``: called once decoder layer ``i`` has every tensor, before the next
    tensor is read (a CPU path lays the layer out there: ``workers/engine_build.py``), and the
    loader's own references to its parameters dropped then: a layer's weights in the load's
    dtype live until it is laid out, not until the whole model is read. ``embed_blocks``: a
    GGUF's quantized token table (and untied head) on a CPU die is held as the file's blocks
    (``workers/layers/block_embedding.py``; for a caller that lays the LM head out on its own).
    ``experts``: "int8" / "int4", the layout a CPU die's routed experts are quantized into as
    their pieces arrive (``_experts_on_arrival``; the caller's path then holds them so:
    ``MoE.quantize``). ``gguf``: the model's GGUF header when the caller has parsed it
    (``model_config.read_model``)."""
    model_path = Path(model_path)
    g = gguf
    if g is None:
        with gguf_errors():
            found = find_gguf(model_path)
            g = read_gguf(found) if found is not None else None
    found = None if g is None else g.path
    headers: dict[Path, dict] = {}  # safetensors files' headers (a GGUF file has none)
    if g is not None:
        cfg, source = cfg or gguf_config(g), "the GGUF metadata"
    else:
        cfg, source = cfg or load_config(model_path), "config.json"
        headers = {f: check_safetensors(f) for f in weight_files(model_path)}
    devs = [torch.device(d) for d in (devices or ["cpu"])]
    dt = resolve_dtype(dtype, cfg, devs[0])
    fam = family(cfg)
    model = _empty_model(fam.build, cfg, devs, dt)
    targets = fam.targets(model, cfg)
    as_blocks = _table_as_blocks(model, cfg, g, targets, dt) if embed_blocks and g is not None else set()
    wanted = _Wanted(targets, fam)
    tensors = (
        iter_tensors(g, cfg, wanted, as_blocks=as_blocks, lazy=True)
        if g is not None
        else _safetensors_tensors(headers, wanted, fam.checkpoint_name)
    )
    watch = None if on_layer is None else _LayerWatch(model, targets, on_layer)
    if experts is not None:
        _experts_on_arrival(model, targets, experts)
    filled = _fill(targets, _pieces(tensors, fam, targets), source, progress, watch)

    missing = [n for n in targets if n not in filled]
    if missing == ["lm_head.weight"]:
        # No lm_head in the checkpoint: tie it to the embeddings, as transformers does.
        model.lm_head = None
        missing = []
    if missing:
        shown = ", ".join(missing[:3]) + (f" and {len(missing) - 3} more" if len(missing) > 3 else "")
        raise LoadError("invalid", f"{found or model_path}: checkpoint lacks tensor(s) {shown}")
    for layer, dev in zip(model.layers, model.layer_devices):
        if dev.type != "cpu":  # no MXFP4 kernel there: the experts dequantized, exactly
            for m in layer.modules():
                if isinstance(m, MoE):
                    m.unpack_mxfp4(dt)
    model.eval()
    return model, cfg


EMBED = "model.embed_tokens.weight"  # the token table's name, in the families that have one so
HEAD = "lm_head.weight"  # an untied LM head's


def _table_as_blocks(
    model: DecoderLM, cfg: ModelConfig, g: GGUFFile, targets: dict[str, Target], dt: torch.dtype
) -> set[str]:
    """Hold the token table, and an untied LM head, as the file's blocks (``BlockEmbedding``)
    where they may be: on the CPU, stored in a block type the family keeps as it is
    (``table_blocks``); the names to read as blocks (empty: both stay dense). The head is held so
    only until the caller lays it out (``cpu_paths.head_linear``: its int8 rows made from the
    blocks, never the whole head in fp32: 1.2 GB for Qwen3-30B-A3B's 152k x 2048)."""
    names: set[str] = set()
    for name, attr in ((EMBED, "embed_tokens"), (HEAD, "lm_head")):
        dense = getattr(model, attr)  # [V, H] weight either way
        if name not in targets or not isinstance(dense, nn.Embedding | nn.Linear):
            continue
        if getattr(dense, "bias", None) is not None:  # (a head with a bias keeps its own layout)
            continue
        kind = table_blocks(g, cfg, name) if dense.weight.device.type == "cpu" else None
        if kind is not None:
            rows, cols = dense.weight.shape
            held = BlockEmbedding(rows, cols, kind, dt, dense.weight.device)
            setattr(model, attr, held)  # (the dense storage, allocated untouched, goes with it)
            targets[name] = Target(held.blocks, 0, rows)
            names.add(name)
    return names


def _experts_on_arrival(model: DecoderLM, targets: dict[str, Target], layout: str) -> None:
    """Each CPU layer's routed experts quantized into ``layout`` as their pieces arrive
    (``MoE.receive``): an expert's target fills a scratch of one expert's matrix in the load's
    dtype, then puts its rows into the stack (``QuantExperts.put``). A load then holds one
    matrix of experts in that dtype, not a layer's stacks (2.4 GB in fp32 a Qwen3-30B-A3B
    layer). A mixture whose stack a target fills whole (Gemma 4's stacked checkpoint tensors)
    is left to be quantized once loaded, as before."""
    by_stack: dict[int, list[str]] = {}  # targets by their parameter's storage
    for name, t in targets.items():
        by_stack.setdefault(_storage(t.param), []).append(name)
    scratch: dict[tuple, torch.Tensor] = {}  # one a shape: the pieces come one at a time
    for layer, dev in zip(model.layers, model.layer_devices):
        if dev.type != "cpu":
            continue
        for m in layer.modules():
            if not isinstance(m, MoE) or m.mxfp4:
                continue
            stacks = (m.gate_up, m.down)  # [E, N, K] each (``receive`` lets them go)
            names = [by_stack.get(_storage(s), []) for s in stacks]
            if any(targets[n].param.dim() != s.dim() - 1 for s, ns in zip(stacks, names) for n in ns):
                continue
            held = m.receive(layout)
            if held is None:
                continue
            for stack, q, ns in zip(stacks, held, names):
                key = (tuple(stack.shape[1:]), stack.dtype, stack.device)
                if key not in scratch:
                    scratch[key] = torch.empty(key[0], dtype=stack.dtype, device=stack.device)
                buf = scratch[key]
                for n in ns:
                    t = targets[n]  # rows of expert e's matrix: a view of the stack
                    e = (t.param.storage_offset() - stack.storage_offset()) // stack.stride(0)
                    put = partial(_put, q, e, buf, t.offset, t.rows)
                    targets[n] = Target(buf, t.offset, t.rows, put)


def _put(q: QuantExperts, e: int, buf: torch.Tensor, offset: int, rows: int) -> None:
    q.put(e, offset, buf[offset : offset + rows])


def load_part(
    model_path: str | Path,
    cfg: ModelConfig,
    targets: dict[str, Target],
    rename: Callable[[str], str | None],
    gguf_rename: Callable[[str], str | None],
) -> None:
    """Fill ``targets`` (the family's names) from the model's checkpoint: each tensor ``rename``
    maps into them (a safetensors name; a GGUF file's: its family name through ``gguf_rename``;
    None: not this part's), stacked and joined ones as ``load_model`` takes them. A part of a
    checkpoint loaded beside its model (Qwen3.5's multi-token-prediction head,
    ``workers/mtp.py``); ``LoadError`` when one is missing."""
    model_path = Path(model_path)
    fam = family(cfg)
    wanted = _Wanted(targets, fam)
    with gguf_errors():
        found = find_gguf(model_path)
        g = read_gguf(found) if found is not None else None
    if g is not None:
        tensors, source = iter_tensors(g, cfg, wanted, gguf_rename), "the GGUF metadata"
    else:
        headers = {f: check_safetensors(f) for f in weight_files(model_path)}
        tensors, source = _safetensors_tensors(headers, wanted, rename), "config.json"
    filled = _fill(targets, _pieces(tensors, fam, targets), source, None)
    missing = [n for n in targets if n not in filled]
    if missing:
        shown = ", ".join(missing[:3]) + (f" and {len(missing) - 3} more" if len(missing) > 3 else "")
        raise LoadError("invalid", f"{model_path}: checkpoint lacks tensor(s) {shown}")


class NoInit(TorchFunctionMode):
    """Skips ``torch.nn.init`` inside: the parameters are filled from the checkpoint, and on the
    meta device those initialisers import ``torch._dynamo`` (seconds, on a load's first call)."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if getattr(func, "__module__", None) == "torch.nn.init":
            return args[0] if args else kwargs.get("tensor")
        return func(*args, **kwargs)


def _empty_model(
    build: Callable[[ModelConfig], DecoderLM], cfg: ModelConfig, devs: list[torch.device], dt: torch.dtype
) -> DecoderLM:
    """The model with uninitialised storage for every parameter on its die."""
    with torch.device("meta"), NoInit():
        model = build(cfg)
    model.to(dt)  # still on meta: the storage below is allocated in ``dt`` at once
    model.layer_devices = layer_placement(cfg.num_layers, devs)
    for name, child in model.named_children():  # embeddings, final norm, head (and a family's own)
        if name != "layers":
            _allocate(child, devs[0])
    for layer, dev in zip(model.layers, model.layer_devices):
        _allocate(layer, dev)
    return model


def _allocate(module: nn.Module, dev: torch.device) -> None:
    """Uninitialised storage on ``dev`` for every parameter and buffer of ``module`` (on the meta
    device), as ``Module.to_empty`` gives, a shared one staying shared. Not ``to_empty``: its
    ``empty_like`` of a meta tensor runs torch's Python reference ops, whose first call imports
    sympy (0.7 s of a load)."""
    params: dict[torch.Tensor, nn.Parameter] = {}
    buffers: dict[torch.Tensor, torch.Tensor] = {}

    def empty(t: torch.Tensor) -> torch.Tensor:
        return torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device=dev)

    for m in module.modules():
        for name, p in m._parameters.items():
            if p is not None:
                if p not in params:
                    params[p] = nn.Parameter(empty(p), p.requires_grad)
                m._parameters[name] = params[p]
        for name, b in m._buffers.items():
            if b is not None:
                if b not in buffers:
                    buffers[b] = empty(b)
                m._buffers[name] = buffers[b]


# (file, label for errors, our name, data: a tensor, or a GGUF tensor's blocks to unpack in place)
Tensors = Iterator[tuple[Path, str, str, "torch.Tensor | Unpacked"]]


class _Wanted:
    """The checkpoint names a load reads: the family's targets, and tensors that stack several
    of them (a mixture of experts' experts: ``workers.models.unstacked``)."""

    def __init__(self, targets: dict[str, Target], fam: Family):
        self.targets, self.fam = targets, fam

    def __contains__(self, name: object) -> bool:
        return isinstance(name, str) and (
            name in self.targets or is_stacked(self.fam, name) or joined_part(self.fam, name) is not None
        )


def _tensor(src: torch.Tensor | Unpacked) -> torch.Tensor:
    return src.tensor() if isinstance(src, Unpacked) else src


def _pieces(tensors: Tensors, fam: Family, targets: dict[str, Target]) -> Tensors:
    """Stacked tensors split into the targets they fill, parts of one weight (MXFP4 blocks and
    scales) joined first (``workers.models.joined_part``); others pass as they are."""
    pending: dict[str, dict[str, torch.Tensor]] = {}
    for f, label, name, src in tensors:
        part = joined_part(fam, name)
        if part is not None:
            key, which = part
            parts = pending.setdefault(key, {})
            parts[which] = _tensor(src)
            pieces = joined_pieces(fam, key, parts)
            if pieces is None:
                continue
            del pending[key]
            for piece, t in pieces:
                if piece not in targets:
                    raise LoadError(
                        "invalid",
                        f"{f}: weight {key!r}: piece {piece!r} is not part of the model its config describes",
                    )
                yield f, f"{key!r} ({piece})", piece, t
            continue
        if not is_stacked(fam, name):
            yield f, label, name, src
            continue
        for piece, t in unstacked(fam, name, _tensor(src)):
            if piece not in targets:
                raise LoadError(
                    "invalid",
                    f"{f}: tensor {label} has shape {list(src.shape)}: piece {piece!r} is not part of "
                    "the model its config describes",
                )
            yield f, f"{label} ({piece})", piece, t
    for key, parts in pending.items():
        raise LoadError("invalid", f"weight {key!r}: the checkpoint has only its {', '.join(sorted(parts))}")


def _safetensors_tensors(
    headers: dict[Path, dict], wanted: Container[str], rename: Callable[[str], str | None]
) -> Tensors:
    """The checkpoint's tensors that we use, file by file, under the family's names (others are
    skipped: e.g. the rotary inv_freq buffers some checkpoints carry, a vision tower).

    Each tensor is read into a buffer of its own (``_read_tensor``), which the filling copies into
    its parameter and lets go: never more than one tensor's bytes beside the model, and no page
    of the file mapped into the worker (a memory map of the whole file would count each page
    read toward its resident memory until the file closes: 13 GB for gpt-oss-20b). Types we do
    not read ourselves go through safetensors' reader."""
    for f, header in headers.items():
        names = [
            (n, ours)
            for n in header
            if n != "__metadata__" and (ours := rename(n)) is not None and ours in wanted
        ]
        base = 8 + struct.unpack("<Q", _head(f))[0]
        try:
            with f.open("rb") as raw, safe_open(str(f), framework="pt", device="cpu") as st:
                for name, ours in names:
                    info = header[name]
                    t = _read_tensor(raw, base, info) if info["dtype"] in _ST_TORCH else st.get_tensor(name)
                    yield f, repr(name), ours, t
        except LoadError:
            raise
        except Exception as e:  # safetensors raises its own error types for damaged files
            raise LoadError("invalid", f"{f}: cannot read safetensors ({e})") from None


_ST_TORCH = {
    "BF16": torch.bfloat16,
    "F16": torch.float16,
    "F32": torch.float32,
    "F64": torch.float64,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
}


def _head(path: Path) -> bytes:
    with path.open("rb") as f:
        return f.read(8)


def _read_tensor(raw, base: int, info: dict) -> torch.Tensor:
    """A tensor's bytes read from the open file ``raw`` (its data section at ``base``) into a
    buffer of their own (``check_safetensors`` has checked its offsets and size)."""
    start, end = info["data_offsets"]
    buf = torch.empty(end - start, dtype=torch.uint8)
    raw.seek(base + start)
    if raw.readinto(buf.numpy().data) != end - start:
        raise LoadError("invalid", f"{raw.name}: truncated safetensors file")
    return buf.view(_ST_TORCH[info["dtype"]]).view(info["shape"])


def _storage(t: torch.Tensor) -> int:
    return t.untyped_storage().data_ptr()


class _LayerWatch:
    """Which decoder layer each target fills (by its parameter's storage), to hand each layer to
    ``on_layer`` as soon as all of its targets are filled, and then forget those targets (the
    loader's references to parameters the layout replaces). A target of no layer (embeddings,
    final norm, head) is never watched; a layer whose targets never all come is left alone (the
    load fails on its missing tensors)."""

    def __init__(
        self, model: DecoderLM, targets: dict[str, Target], on_layer: Callable[[int, nn.Module], None]
    ):
        self.model, self.targets, self.on_layer = model, targets, on_layer
        # by storage: a target may fill a view of its parameter (one expert of a stack)
        owner = {
            _storage(t): i
            for i, layer in enumerate(model.layers)
            for t in (*layer.parameters(), *layer.buffers())
        }
        self.layer_of: dict[str, int] = {}
        self.names: dict[int, list[str]] = {}  # each layer's targets
        for name, t in targets.items():
            i = owner.get(_storage(t.param))
            if i is not None:
                self.layer_of[name] = i
                self.names.setdefault(i, []).append(name)
        self.left = {i: set(names) for i, names in self.names.items()}  # those not filled yet

    def filled(self, name: str) -> None:
        i = self.layer_of.get(name)
        if i is None or i not in self.left:
            return
        left = self.left[i]
        left.discard(name)
        if left:
            return
        del self.left[i]
        for n in self.names.pop(i):
            self.targets.pop(n, None)
        self.on_layer(i, self.model.layers[i])


def _copy(dst: torch.Tensor, src: torch.Tensor) -> None:
    """``dst`` (CPU) filled from ``src``: a copy is memory-bound, and a parallel one waits for
    threads that a busy machine may not schedule soon. Of the same dtype and both contiguous (a
    GGUF's dequantized fp32 into an fp32 parameter, raw blocks into their buffer): one plain
    memcpy (numpy's, on the bytes), single-threaded; else (a cast, a strided piece) in runs of
    rows under torch's parallel grain (a Qwen3.5-0.8B load made 44k such copies, 1.1 s)."""
    if (
        dst.dtype == src.dtype
        and dst.device.type == "cpu"
        and src.device.type == "cpu"
        and dst.is_contiguous()
        and src.is_contiguous()
        and dst.numel()
    ):
        np.copyto(dst.reshape(-1).view(torch.uint8).numpy(), src.reshape(-1).view(torch.uint8).numpy())
        return
    step = max(1, _COPY_VALUES // max(1, src[0].numel()))
    for r in range(0, dst.shape[0], step):
        dst[r : r + step].copy_(src[r : r + step])


def _fill(
    targets: dict[str, Target],
    tensors: Tensors,
    source: str,
    progress: Callable[[int, int], None] | None,
    watch: _LayerWatch | None = None,
) -> set[str]:
    """Copy every checkpoint tensor into its parameter rows; returns the names filled.
    ``watch``: told of each name filled (a layer's targets leave ``targets`` once it is whole)."""
    filled: set[str] = set()
    total, done = len(targets), 0
    for f, label, name, src in tensors:
        if name not in targets:  # a layer laid out already (``watch``): its tensor came twice
            raise LoadError("invalid", f"{f}: tensor {label} fills {name!r} a second time")
        t = targets[name]
        param, off, rows = t.param, t.offset, t.rows
        want = (rows,) + tuple(param.shape[1:])
        if tuple(src.shape) != want:
            raise LoadError(
                "invalid",
                f"{f}: tensor {label} has shape {list(src.shape)}, expected {list(want)} from {source}",
            )
        with torch.no_grad():
            dst = param.detach()[off : off + rows]
            if not (isinstance(src, Unpacked) and src.into(dst)):  # unpacked in place, else copied
                _copy(dst, _tensor(src))
            if t.then is not None:  # (a piece converted as it arrives: ``_experts_on_arrival``)
                t.then()
        del src, param, dst, t
        filled.add(name)
        if watch is not None:
            watch.filled(name)
        done += 1
        if progress:
            progress(done, total)
    return filled
