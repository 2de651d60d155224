"""Our logits against transformers' on the same device, for every architecture the engine serves:
issue 30 §1's reference check, run on ``cuda:0`` by ``bench/gpu_check.py``.

The device is ``PANTHEON_REF_DEVICE`` (default ``cuda:0``); the tests skip when it is absent, and
``PANTHEON_REF_DEVICE=cpu`` runs them here (tests/conftest.py lets the ``gpu`` mark through then),
which is how the test itself is checked without a GPU.

For each preset, on a 40-token prompt (past the 16-token sliding windows of the Gemma and gpt-oss
presets):

* **fp32** (TF32 off): the logits of every prompt position (``Engine.prompt_logits``) and of 16
  greedy decode steps (the engine's own steps, through ``on_logits``) against transformers' fp32
  forward over the same tokens (the prompt plus the engine's tokens, teacher-forced: one forward,
  no ``generate``, so no tie in a random model's flat logits can fork the two paths). Tolerance:
  max |ours - ref| < 1e-4 on the CPU (the CPU reference tests' figure), 2e-4 on a GPU (other
  kernels, other summation orders; TF32 would be ~1e-2 and fail it).
* **bf16** (weights and compute): the same rows, each judged against transformers' **fp32** logits
  by the error relative to the row set's largest logit, ``max |x - ref32| / max |ref32|``. Ours must
  be within ``max(2 x transformers' own bf16 error, 0.03)``; and our greedy token must be the fp32
  argmax at every step where the fp32 margin (top-1 minus top-2) is wider than twice the allowed
  error (a clear decision; a near tie may go either way in bf16).

An architecture the device's transformers does not have (an older version) skips with the reason.
"""

from __future__ import annotations

import os

import pytest
import torch

from pantheon.core.protocol import SamplingParams
from workers.engine import Engine

pytestmark = pytest.mark.gpu(ref_device=True)

transformers = pytest.importorskip("transformers")

DEVICE = os.environ.get("PANTHEON_REF_DEVICE", "cuda:0")
ON_GPU = DEVICE.startswith("cuda")
FP32_TOL = 2e-4 if ON_GPU else 1e-4
BF16_FLOOR = 0.03
N_STEPS = 16
# 40 tokens: past the 16-token windows (tests/helpers/window_reference.py's prompt)
PROMPT = [7, 300, 12, 99, 5, 1000, 42, 17, 256, 3, 77, 1500, 8, 64, 900, 11, 23, 400, 6, 88] * 2

# every architecture the engine serves, as a make-model preset
PRESETS = [
    "tiny-llama",
    "tiny-qwen2",
    "tiny",  # Qwen3
    "tiny-qwen3.5-text",
    "tiny-qwen3.5",  # the Hub's multimodal layout
    "tiny-gemma3",
    "tiny-gemma4",
    "tiny-gemma4-moe",
    "tiny-gpt-oss",
    "tiny-qwen3-moe",
    "tiny-qwen3.5-moe",
]


@pytest.fixture(scope="module", autouse=True)
def _device():
    if ON_GPU:
        if not torch.cuda.is_available():
            pytest.skip(f"{DEVICE}: no CUDA device")
        index = torch.device(DEVICE).index or 0
        if index >= torch.cuda.device_count():
            pytest.skip(f"{DEVICE}: only {torch.cuda.device_count()} CUDA device(s)")
        tf32 = (torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32)
        torch.backends.cuda.matmul.allow_tf32 = False  # fp32 must be fp32: TF32 is ~1e-3 relative
        torch.backends.cudnn.allow_tf32 = False
        yield
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = tf32
    else:
        yield


def hf_model(path, dtype: torch.dtype):
    try:
        model = transformers.AutoModelForCausalLM.from_pretrained(str(path), dtype=dtype)
    except (ValueError, KeyError, ImportError) as e:  # an architecture this transformers lacks
        pytest.skip(f"transformers {transformers.__version__} cannot load it: {str(e)[:120]}")
    return model.to(DEVICE).eval()


def hf_logits(model, ids: list[int]) -> torch.Tensor:
    """[T, V] fp32 on the CPU."""
    with torch.no_grad():
        return model(torch.tensor([ids], device=DEVICE)).logits[0].float().cpu()


def ours(path, dtype: str) -> tuple[torch.Tensor, list[int], torch.Tensor]:
    """Our prompt logits [T, V], the greedy tokens of N_STEPS steps and each step's row [N, V]."""
    eng = Engine(str(path), devices=[DEVICE], dtype=dtype, kv_budget_bytes=16 << 20)
    prompt_rows = eng.prompt_logits(PROMPT).float().cpu()
    rows: list[torch.Tensor] = []
    eng.on_logits = lambda seqs, logits: rows.append(logits[0].float().cpu().clone())
    eng.submit("r", PROMPT, SamplingParams(temperature=0.0, max_tokens=N_STEPS, ignore_eos=True))
    tokens: list[int] = []
    while eng.has_work():
        tokens += [o.token for o in eng.step()]
    assert len(tokens) == len(rows) == N_STEPS
    return prompt_rows, tokens, torch.stack(rows)


def forced(ref_all: torch.Tensor) -> torch.Tensor:
    """transformers' rows that predict our N_STEPS tokens (the last prompt position on)."""
    return ref_all[len(PROMPT) - 1 : len(PROMPT) - 1 + N_STEPS]


def rel(x: torch.Tensor, ref: torch.Tensor) -> float:
    return ((x - ref).abs().max() / ref.abs().max()).item()


@pytest.mark.parametrize("preset", PRESETS)
def test_fp32_logits_match_transformers_on_the_device(model_factory, preset):
    path = model_factory(preset, dtype="float32")
    hf = hf_model(path, torch.float32)  # first: skips where this transformers lacks the architecture
    prompt_rows, tokens, rows = ours(path, "float32")
    ref = hf_logits(hf, PROMPT + tokens[:-1])
    assert prompt_rows.shape == ref[: len(PROMPT)].shape
    assert ref.std().item() > 1e-2  # logits that tell tokens apart
    err_prompt = (prompt_rows - ref[: len(PROMPT)]).abs().max().item()
    err_decode = (rows - forced(ref)).abs().max(dim=1).values
    assert err_prompt < FP32_TOL, f"{DEVICE} prompt: max |diff| {err_prompt:.2e}"
    bad = [(i, f"{e:.2e}") for i, e in enumerate(err_decode.tolist()) if e >= FP32_TOL]
    assert not bad, f"{DEVICE} decode steps over {FP32_TOL:.0e}: {bad}"
    assert tokens == forced(ref).argmax(dim=1).tolist()


@pytest.mark.parametrize("preset", PRESETS)
def test_bf16_logits_near_transformers_fp32_on_the_device(model_factory, preset):
    path = model_factory(preset, dtype="float32")
    hf32, hf16 = hf_model(path, torch.float32), hf_model(path, torch.bfloat16)
    prompt_rows, tokens, rows = ours(path, "bfloat16")
    ids = PROMPT + tokens[:-1]
    ref32, ref16 = hf_logits(hf32, ids), hf_logits(hf16, ids)
    theirs = rel(ref16, ref32)
    allowed = max(2 * theirs, BF16_FLOOR)
    err_prompt = rel(prompt_rows, ref32[: len(PROMPT)])
    err_decode = rel(rows, forced(ref32))
    msg = f"{DEVICE}: ours {err_prompt:.3f} (prompt) / {err_decode:.3f} (decode), transformers' bf16 {theirs:.3f}"
    print(msg)
    assert err_prompt <= allowed and err_decode <= allowed, msg
    top2 = forced(ref32).topk(2, dim=1).values
    scale = ref32.abs().max().item()
    clear = ((top2[:, 0] - top2[:, 1]) > 2 * allowed * scale).tolist()
    want = forced(ref32).argmax(dim=1).tolist()
    wrong = [i for i, c in enumerate(clear) if c and tokens[i] != want[i]]
    assert not wrong, f"{msg}; greedy token differs from fp32's at clear steps {wrong}"
