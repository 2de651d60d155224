"""A model's generation defaults, and how they fill the sampling fields a request leaves out.

A chat, responses or completion request's sampling fields (``FIELDS``) that the client did not
give come from, in order:

1. the catalog entry's ``params`` (``Instance.params``: a start model's ``ModelSpec.params``,
   checked by ``check_params``);
2. the model's own recommendation, read once per load into ``ModelAssets.generation_defaults``:
   a Hugging Face folder's ``generation_config.json`` (``from_generation_config``) or a GGUF
   file's ``general.sampling.*`` metadata, which llama.cpp's converter writes from that same file
   (``from_gguf``);
3. OpenAI's defaults (``OPENAI``, which are ``GenerationRequest``'s own).

A field the client gave is never replaced, even when it holds OpenAI's value (an explicit
``temperature: 1.0`` stays 1.0): the request records which it left out (``GenerationRequest.unset``)
and ``apply`` fills only those. ``apply`` sets every such field from the layers each time it runs,
so applying it again for another replica (or a retry after a worker restart) is exact.

``generation_config.json`` is read as vLLM reads it (``ModelConfig.get_diff_sampling_param``):
``temperature``, ``top_p``, ``top_k``, ``min_p``, ``repetition_penalty`` and ``max_new_tokens``
(as ``max_tokens``); ``do_sample`` is ignored (a ``do_sample: false`` file does not make the
model greedy there either), and so is ``max_length`` (a prompt-plus-output length).

A value a model file holds that no request could hold (out of the range the API takes, not a
number) is ignored, with a warning in the log: a model file's mistake never fails a load, and a
guessed clamp would be a setting nobody chose. A catalog's params are the operator's own: there
the same value is an error at startup (``check_params`` raises ``ValueError``).

``max_tokens``: a default one is a ceiling, never a reservation (vLLM's reading of
``max_new_tokens``): the completion ends at the default or where the context ends, whichever is
first, and the context is fitted as for a request without ``max_tokens``. A default therefore
never turns a request that runs into a 400 or a capped conversation (``ceiling``).
"""

from __future__ import annotations

import json
import logging
import math
import struct
from collections.abc import Mapping
from pathlib import Path
from typing import NamedTuple, Protocol

from pantheon.core.request import GenerationRequest

log = logging.getLogger(__name__)

Params = dict[str, float | int]


class Field(NamedTuple):
    """A defaultable field: its type and the range a request may give it (``pantheon.api.fields``')."""

    kind: type  # float or int
    lo: float
    hi: float
    lo_open: bool = False  # lo itself is out of range


FIELDS: dict[str, Field] = {
    "temperature": Field(float, 0.0, 2.0),
    "top_p": Field(float, 0.0, 1.0),
    "top_k": Field(int, -1, 2**63 - 1),  # -1 (vLLM's "off") is 0 (off) here
    "min_p": Field(float, 0.0, 1.0),
    "repetition_penalty": Field(float, 0.0, 10.0, lo_open=True),
    "repetition_window": Field(int, -1, 2**63 - 1),  # llama.cpp's repeat_last_n
    "max_tokens": Field(int, 1, 2**63 - 1),
}
# OpenAI's defaults (and the extensions' neutral ones): GenerationRequest's own, checked equal by a test.
# max_tokens None: the rest of the context.
OPENAI: dict[str, float | int | None] = {
    "temperature": 1.0,
    "top_p": 1.0,
    "top_k": 0,
    "min_p": 0.0,
    "repetition_penalty": 1.0,
    "repetition_window": 64,
    "max_tokens": None,
}
SAMPLING = tuple(k for k in FIELDS if k != "max_tokens")  # what ``apply`` sets on the request

# generation_config.json key -> field (vLLM's list)
HF_KEYS = {
    "temperature": "temperature",
    "top_p": "top_p",
    "top_k": "top_k",
    "min_p": "min_p",
    "repetition_penalty": "repetition_penalty",
    "max_new_tokens": "max_tokens",
}
# GGUF metadata key (llama.cpp's gguf-py Keys.General.SAMPLING_*) -> field. The others it
# defines (sequence, xtc_*, mirostat*) are samplers this server does not have.
GGUF_KEYS = {
    "general.sampling.temp": "temperature",
    "general.sampling.top_p": "top_p",
    "general.sampling.top_k": "top_k",
    "general.sampling.min_p": "min_p",
    "general.sampling.penalty_repeat": "repetition_penalty",
    "general.sampling.penalty_last_n": "repetition_window",
}


def value(name: str, v: object) -> float | int:
    """``v`` as field ``name`` takes it (a float, or an int: ``2.0`` is 2 for an int field);
    raises ``ValueError`` saying why not."""
    spec = FIELDS.get(name)
    if spec is None:
        raise ValueError(f"{name!r} is not a sampling default (one of {', '.join(FIELDS)})")
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        raise ValueError(f"{name} must be a number, got {type(v).__name__}")
    if spec.kind is int:
        if isinstance(v, float) and not v.is_integer():
            raise ValueError(f"{name} must be an integer, got {v}")
        out: float | int = int(v)
    else:
        if not math.isfinite(v):
            raise ValueError(f"{name} must be a finite number, got {v}")
        out = float(v)
    if out < spec.lo or (spec.lo_open and out == spec.lo) or out > spec.hi:
        lo = f"> {spec.lo:g}" if spec.lo_open else f">= {spec.lo:g}"
        rng = lo if spec.hi >= 2**63 - 1 else f"{lo} and <= {spec.hi:g}"
        raise ValueError(f"{name} must be {rng}, got {v}")
    if name == "top_k":
        out = max(int(out), 0)
    return out


def check_params(params: Mapping[str, object] | None) -> Params:
    """A catalog entry's ``params``, checked: an unknown key or a value out of range raises
    ``ValueError`` naming it (the operator's own setting: refused, never ignored)."""
    if params is None:
        return {}
    if not isinstance(params, Mapping):
        raise ValueError(f"params must be a table of sampling defaults, got {type(params).__name__}")
    return {str(k): value(str(k), v) for k, v in params.items()}


def _kept(pairs: list[tuple[str, str, object]], source: str) -> Params:
    """``(field, key, value)`` read from a model file -> the valid ones; each invalid one is
    logged and left out."""
    out: Params = {}
    for name, key, v in pairs:
        if v is None:
            continue
        try:
            out[name] = value(name, v)
        except ValueError as e:
            log.warning("%s: %s ignored: %s", source, key, e)
    return out


def from_generation_config(path: str | Path) -> Params:
    """The sampling defaults of a Hugging Face ``generation_config.json`` (see the module doc).
    A missing file is none; an unreadable one is none too, logged."""
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        log.debug("%s: no generation_config.json: no model sampling defaults", path)
        return {}
    except (OSError, UnicodeDecodeError) as e:
        log.warning("%s: unreadable, no model sampling defaults: %s", path, e)
        return {}
    try:
        data = json.loads(text)
    except ValueError as e:
        log.warning("%s: not valid JSON, no model sampling defaults: %s", path, e)
        return {}
    if not isinstance(data, dict):
        log.warning("%s: not a JSON object, no model sampling defaults", path)
        return {}
    return _kept([(name, key, data.get(key)) for key, name in HF_KEYS.items()], str(path))


def from_gguf(meta: Mapping[str, object], source: str = "GGUF") -> Params:
    """The sampling defaults of a GGUF file's metadata (``general.sampling.*``). Its floats are
    float32: each is read as the shortest decimal that is the same float32 (0.95, not
    0.949999988079071)."""
    pairs = []
    for key, name in GGUF_KEYS.items():
        v = meta.get(key)
        if isinstance(v, float) and FIELDS[name].kind is float:
            v = _shortest_f32(v)
        pairs.append((name, key, v))
    return _kept(pairs, source)


def _shortest_f32(x: float) -> float:
    """The shortest decimal whose float32 is ``x``'s (``x`` itself when ``x`` is no float32)."""
    if not math.isfinite(x):
        return x
    for digits in range(1, 10):
        d = float(f"{x:.{digits}g}")
        try:
            if struct.unpack("<f", struct.pack("<f", d))[0] == x:
                return d
        except OverflowError:
            return x
    return x


def merged(params: Mapping[str, float | int], model: Mapping[str, float | int]) -> Params:
    """Layers 1 over 2: the catalog entry's ``params`` over the model's own; only what is set."""
    return {**model, **params}


class _HasDefaults(Protocol):
    @property
    def params(self) -> dict[str, float | int]: ...
    @property
    def assets(self) -> object: ...  # read-only: any instance's assets (or None) will do


def in_force(inst: _HasDefaults) -> Params:
    """The defaults in force for an instance (layers 1 and 2, what ``/v1/models`` shows)."""
    model = getattr(inst.assets, "generation_defaults", None) or {}
    return merged(inst.params, model)


def apply(req: GenerationRequest, defaults: Mapping[str, float | int]) -> None:
    """Set each sampling field ``req`` left unset from ``defaults`` (layers 1 and 2), else to
    OpenAI's default. In place, and exact to repeat for another instance."""
    for name in SAMPLING:
        if name in req.unset:
            setattr(req, name, defaults.get(name, OPENAI[name]))


def ceiling(req: GenerationRequest, defaults: Mapping[str, float | int]) -> int | None:
    """The default ``max_tokens`` for ``req``: None when the client gave its own or there is no
    default. A ceiling on the completion (see the module doc), never a reservation."""
    if "max_tokens" not in req.unset:
        return None
    v = defaults.get("max_tokens")
    return None if v is None else int(v)


def capped(req: GenerationRequest, defaults: Mapping[str, float | int], max_tokens: int) -> int:
    """``max_tokens`` as fitted to the context, under the default ceiling (if any)."""
    c = ceiling(req, defaults)
    return max_tokens if c is None else min(max_tokens, c)
