"""A reference for the multi-token-prediction draft (``workers/mtp.py``), from transformers'
Qwen3.5 modules and the checkpoint's ``mtp.*`` tensors, as vLLM's ``Qwen3_5MultiTokenPredictor``
computes it: ``norm(layer(fc([norm_e(embed(t[p+1])) ; norm_h(h[p])])))``, ``h`` the target's
final (normed) hidden states, then the head's own outputs for each further draft. Every pass
recomputes the whole sequence (no cache), fp32."""

from __future__ import annotations

from pathlib import Path

import torch
from safetensors.torch import load_file


@torch.inference_mode()
def mtp_drafts(path: Path, tokens: list[int], k: int) -> list[int]:
    """The head's greedy drafts for ``tokens`` (the last one pending: the target has not run it)."""
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
    tm, cfg = model.model, model.config
    ckpt: dict[str, torch.Tensor] = {}
    for f in sorted(Path(path).glob("*.safetensors")):
        ckpt.update({n: t.float() for n, t in load_file(str(f)).items() if n.startswith("mtp.")})
    full = list(cfg.layer_types).index("full_attention")
    layer = type(tm.layers[full])(cfg, full).float().eval()  # a fresh full-attention decoder layer
    layer.load_state_dict(
        {n[len("mtp.layers.0.") :]: t for n, t in ckpt.items() if n.startswith("mtp.layers.0.")}
    )
    norms = {}
    for name in ("pre_fc_norm_embedding", "pre_fc_norm_hidden", "norm"):
        norms[name] = type(tm.norm)(cfg.hidden_size, eps=cfg.rms_norm_eps).float().eval()
        norms[name].weight.copy_(ckpt[f"mtp.{name}.weight"])
    fc = ckpt["mtp.fc.weight"]  # [H, 2H]
    h = tm(input_ids=torch.tensor([tokens[:-1]])).last_hidden_state[0]  # [L-1, H]
    feed, states, drafts = list(tokens[1:]), h, []
    for _ in range(k):
        e = norms["pre_fc_norm_embedding"](tm.embed_tokens(torch.tensor(feed)))
        x = torch.cat((e, norms["pre_fc_norm_hidden"](states)), dim=-1) @ fc.T  # [n, H]
        pos = torch.arange(len(feed)).view(1, 1, -1).expand(3, 1, -1)  # text: t = h = w positions
        rot = tm.rotary_emb(x[None], pos)
        y = norms["norm"](layer(x[None], position_embeddings=rot, attention_mask=None)[0])  # [n, H]
        d = int(model.lm_head(y[-1]).argmax())
        drafts.append(d)
        feed.append(d)
        states = torch.cat((states, y[-1:]))
    return drafts
