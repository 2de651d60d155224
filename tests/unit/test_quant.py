"""int8 weight-only quantization: about half the weight bytes, logits close to bf16."""

import torch

from pantheon.protocol import SamplingParams
from workers.engine import Engine


def test_int8_halves_weights_and_stays_close(model_factory):
    path = str(model_factory("tiny-llama", num_hidden_layers=4, hidden_size=256, intermediate_size=768))
    full = Engine(path, dtype="bfloat16", kv_budget_bytes=1 << 20)
    quant = Engine(path, dtype="bfloat16", kv_budget_bytes=1 << 20, quantize=True)
    layer_bytes = lambda e: sum(  # noqa: E731
        t.numel() * t.element_size()
        for t in list(e.model.layers.parameters()) + list(e.model.layers.buffers())
    )
    assert layer_bytes(quant) < 0.55 * layer_bytes(full)
    rows = {}
    for name, eng in (("full", full), ("quant", quant)):
        eng.on_logits = lambda seqs, logits, name=name: rows.setdefault(name, logits[0].clone())
        eng.submit("r", list(range(10, 30)), SamplingParams(temperature=0.0, max_tokens=1))
        while eng.has_work():
            eng.step()
    a, b = rows["full"], rows["quant"]
    cos = torch.nn.functional.cosine_similarity(a, b, dim=0)
    assert cos > 0.99, cos


def test_quantize_int8_keeps_the_weights_dtype(model_factory):
    """The CUDA dies' int8 (quant.quantize_int8): scales in the model's own dtype, plain head."""
    from workers.loader import load_model
    from workers.quant import Int8Linear, quantize_int8

    model, _ = load_model(model_factory("tiny-llama", dtype="float32"), dtype="float32")
    quantize_int8(model)
    lin = model.layers[0].self_attn.qkv_proj
    assert isinstance(lin, Int8Linear) and lin.scale.dtype == torch.float32
    assert isinstance(model.lm_head, torch.nn.Linear)
    assert lin(torch.randn(2, lin.in_features)).dtype == torch.float32
