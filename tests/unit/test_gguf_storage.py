"""How a GGUF file stores its matrices (``pantheon.core.gguf.storage``), which decides the CPU
paths a load may take (``sizing.cpu_path_names``): exactly, on the tensor lists llama.cpp's
converter and ``llama-quantize`` write (names, types and shapes as they are in those files; no
data needed). A mixture of experts' router is kept F32 by every quantizer, and its expert stacks
are 3-D: before this, a Q4_K_M or Q8_0 mixture of experts read as unquantized (its router) and
4-bit only by its attention, and went on a timed bf16 path at twice the bytes a step."""

from __future__ import annotations

from pantheon.core.gguf import GGUFTensor, storage


def _t(name: str, kind: str, *shape: int) -> tuple[str, GGUFTensor]:
    return name, GGUFTensor(name, 0, kind, tuple(shape), 0, 0)


def _files(
    attn: str, experts: str, down_exps: str, router: str = "F32", head: str = "Q6_K"
) -> dict[str, GGUFTensor]:
    """A two-layer Qwen3-30B-A3B-shaped file (llama.cpp's tensor names, torch-order shapes)."""
    ts = [_t("token_embd.weight", attn, 151936, 2048), _t("output.weight", head, 151936, 2048)]
    for i in range(2):
        b = f"blk.{i}"
        ts += [
            _t(f"{b}.attn_norm.weight", "F32", 2048),
            _t(f"{b}.attn_q.weight", attn, 4096, 2048),
            _t(f"{b}.attn_k.weight", attn, 512, 2048),
            _t(f"{b}.attn_v.weight", "Q6_K" if attn == "Q4_K" else attn, 512, 2048),
            _t(f"{b}.attn_output.weight", attn, 2048, 4096),
            _t(f"{b}.ffn_gate_inp.weight", router, 128, 2048),
            _t(f"{b}.ffn_gate_exps.weight", experts, 128, 768, 2048),
            _t(f"{b}.ffn_up_exps.weight", experts, 128, 768, 2048),
            _t(f"{b}.ffn_down_exps.weight", down_exps, 128, 2048, 768),
        ]
    return dict(ts)


def test_a_quantized_mixture_of_experts_reads_as_quantized_whatever_its_router():
    assert storage(_files("Q4_K", "Q4_K", "Q4_K")) == ("bfloat16", True, True)  # Q4_K_M
    assert storage(_files("Q4_K", "Q4_K", "Q6_K")) == ("bfloat16", True, True)  # its Q6_K downs: a third
    assert storage(_files("Q8_0", "Q8_0", "Q8_0", head="Q8_0")) == ("bfloat16", True, False)
    # the experts counted: 4-bit attention alone over 8-bit experts is not a 4-bit file
    assert storage(_files("Q4_K", "Q8_0", "Q8_0")) == ("bfloat16", True, False)
    assert storage(_files("Q8_0", "Q4_K", "Q4_K", head="Q8_0")) == ("bfloat16", True, True)


def test_float_files_are_not_quantized_and_keep_their_dtype():
    assert storage(_files("F32", "F32", "F32", head="F32")) == ("float32", False, False)
    assert storage(_files("BF16", "BF16", "BF16", head="BF16")) == ("bfloat16", False, False)
    assert storage(_files("F16", "F16", "F16", router="F16", head="F16")) == ("float16", False, False)
    # one float matrix that is not a router: not stored quantized
    mixed = _files("Q4_K", "Q4_K", "Q4_K")
    mixed.update([_t("blk.0.attn_q.weight", "BF16", 4096, 2048)])
    assert storage(mixed)[1:] == (False, False)


def test_mxfp4_experts_and_short_rows_are_not_the_files_matrices():
    """gpt-oss as llama.cpp's converter writes it (bf16, its experts MXFP4 as they ship): a bf16
    file; Qwen3.5's [C, 4] convolution taps (F32 in a Q4_K_M file) change nothing."""
    oss = dict(
        [
            _t("token_embd.weight", "BF16", 201088, 2880),
            _t("blk.0.attn_q.weight", "BF16", 4096, 2880),
            _t("blk.0.ffn_gate_inp.weight", "F32", 32, 2880),
            _t("blk.0.ffn_gate_exps.weight", "MXFP4", 32, 2880, 2880),
            _t("blk.0.ffn_down_exps.weight", "MXFP4", 32, 2880, 2880),
        ]
    )
    assert storage(oss) == ("bfloat16", False, False)
    q35 = dict(
        [
            _t("token_embd.weight", "Q6_K", 248320, 1024),
            _t("blk.0.attn_qkv.weight", "Q4_K", 8192, 1024),
            _t("blk.0.ssm_conv1d.weight", "F32", 6144, 4),
            _t("blk.0.ffn_down.weight", "Q6_K", 1024, 3584),
        ]
    )
    assert storage(q35) == ("bfloat16", True, True)
    assert storage({}) == ("bfloat16", False, False)
