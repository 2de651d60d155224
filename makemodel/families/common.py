"""What the presets of several families share: our tokenizer's ids and the tiny shapes."""

from __future__ import annotations

from makemodel import tokenizer_train as tt

TINY_VOCAB = -(-tt.VOCAB_SIZE // 64) * 64  # 4032: the tokenizer's size rounded up to 64
IDS = dict(
    bos_token_id=tt.TOKEN_IDS[tt.BOS_TOKEN],
    eos_token_id=tt.TOKEN_IDS[tt.EOS_TOKEN],
)
TINY_SHAPES = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    vocab_size=TINY_VOCAB,
    max_position_embeddings=4096,
)
