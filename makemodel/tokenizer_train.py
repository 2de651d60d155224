"""The tokenizer shipped with ``pantheon make-model`` folders.

A byte-level BPE (GPT-2 / Qwen style: Qwen's split regex, NFC, ByteLevel pre-tokenizer and decoder)
trained with the ``tokenizers`` library on the text in ``makemodel/data/``, plus Qwen3's chat tokens
as added tokens, and a ChatML chat template of our own. Training is deterministic and takes a
fraction of a second; the result is cached per process.

Token ids: the trained BPE vocabulary is ``0 .. BPE_VOCAB_SIZE-1`` (the 256 byte symbols, then the
merges); the added tokens follow in ``ADDED_TOKENS`` order, as in Qwen's tokenizer.
"""

from __future__ import annotations

import functools
import json
from pathlib import Path

DATA_DIR = Path(__file__).parent / "data"

BPE_VOCAB_SIZE = 3991  # learned tokens (256 bytes + merges); the corpus supports ~4280

# (content, special). As in Qwen3: the ChatML markers are special (skipped by
# ``decode(skip_special_tokens=True)``), the think / tool tags are plain added tokens (kept).
ADDED_TOKENS: list[tuple[str, bool]] = [
    ("<|endoftext|>", True),
    ("<|im_start|>", True),
    ("<|im_end|>", True),
    ("<tool_call>", False),
    ("</tool_call>", False),
    ("<tool_response>", False),
    ("</tool_response>", False),
    ("<think>", False),
    ("</think>", False),
]
TOKEN_IDS: dict[str, int] = {tok: BPE_VOCAB_SIZE + i for i, (tok, _) in enumerate(ADDED_TOKENS)}
VOCAB_SIZE = BPE_VOCAB_SIZE + len(ADDED_TOKENS)  # 4000

BOS_TOKEN = PAD_TOKEN = "<|endoftext|>"
EOS_TOKEN = "<|im_end|>"

# Qwen2/Qwen3's pre-tokenizer split: contractions, letter runs, single digits, punctuation runs,
# newlines, spaces.
SPLIT_REGEX = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)

# ChatML, Qwen3 style (our own, shorter text). Every tag uses '-' whitespace control, so the output
# does not depend on trim_blocks / lstrip_blocks. Variables: messages, tools, add_generation_prompt,
# enable_thinking. Message content may be a string, None or a list of {"type": "text"} parts.
CHAT_TEMPLATE = """\
{%- macro text(content) -%}
  {%- if content is string -%}{{- content -}}
  {%- elif content is iterable -%}
    {%- for part in content if part.type == 'text' -%}{{- part.text -}}{%- endfor -%}
  {%- endif -%}
{%- endmacro -%}
{%- set msgs = messages -%}
{%- if tools or (messages and messages[0].role == 'system') -%}
  {{- '<|im_start|>system\\n' -}}
  {%- if messages and messages[0].role == 'system' -%}
    {{- text(messages[0].content) -}}
    {%- set msgs = messages[1:] -%}
    {%- if tools -%}{{- '\\n\\n' -}}{%- endif -%}
  {%- endif -%}
  {%- if tools -%}
    {{- '# Tools\\n\\nYou may call one or more of these functions. Their signatures:\\n<tools>' -}}
    {%- for tool in tools -%}{{- '\\n' + (tool | tojson) -}}{%- endfor -%}
    {{- '\\n</tools>\\n\\nTo call a function, reply with <tool_call></tool_call> tags around a JSON '
        'object:\\n<tool_call>\\n{"name": <function-name>, "arguments": <args-json-object>}\\n'
        '</tool_call>' -}}
  {%- endif -%}
  {{- '<|im_end|>\\n' -}}
{%- endif -%}
{#- Reasoning is shown only for assistant turns after the last user turn (the current tool loop). -#}
{%- set ns = namespace(last_user=-1) -%}
{%- for m in msgs -%}{%- if m.role == 'user' -%}{%- set ns.last_user = loop.index0 -%}{%- endif -%}{%- endfor -%}
{%- for m in msgs -%}
  {%- if m.role == 'user' or m.role == 'system' -%}
    {{- '<|im_start|>' + m.role + '\\n' + text(m.content) + '<|im_end|>\\n' -}}
  {%- elif m.role == 'assistant' -%}
    {{- '<|im_start|>assistant\\n' -}}
    {%- if m.reasoning_content and loop.index0 > ns.last_user -%}
      {{- '<think>\\n' + m.reasoning_content.strip('\\n') + '\\n</think>\\n\\n' -}}
    {%- endif -%}
    {{- text(m.content) -}}
    {%- for call in m.tool_calls or [] -%}
      {%- set f = call.function if call.function is defined else call -%}
      {%- if m.content or not loop.first -%}{{- '\\n' -}}{%- endif -%}
      {{- '<tool_call>\\n{"name": "' + f.name + '", "arguments": ' -}}
      {{- f.arguments if f.arguments is string else (f.arguments | tojson) -}}
      {{- '}\\n</tool_call>' -}}
    {%- endfor -%}
    {{- '<|im_end|>\\n' -}}
  {%- elif m.role == 'tool' -%}
    {%- if loop.first or msgs[loop.index0 - 1].role != 'tool' -%}{{- '<|im_start|>user' -}}{%- endif -%}
    {{- '\\n<tool_response>\\n' + text(m.content) + '\\n</tool_response>' -}}
    {%- if loop.last or msgs[loop.index0 + 1].role != 'tool' -%}{{- '<|im_end|>\\n' -}}{%- endif -%}
  {%- endif -%}
{%- endfor -%}
{%- if add_generation_prompt -%}
  {{- '<|im_start|>assistant\\n' -}}
  {%- if enable_thinking is defined and enable_thinking is false -%}
    {{- '<think>\\n\\n</think>\\n\\n' -}}
  {%- endif -%}
{%- endif -%}
"""


def corpus_documents() -> list[str]:
    """The training text: every ``makemodel/data/*.txt`` (sorted), split into paragraphs."""
    docs: list[str] = []
    for path in sorted(DATA_DIR.glob("*.txt")):
        docs += [p for p in path.read_text(encoding="utf-8").split("\n\n") if p.strip()]
    return docs


def train_tokenizer():
    """Train the BPE from scratch and return a ``tokenizers.Tokenizer`` (uncached)."""
    from tokenizers import (
        AddedToken,
        Regex,
        Tokenizer,
        decoders,
        models,
        normalizers,
        pre_tokenizers,
        processors,
        trainers,
    )

    tok = Tokenizer(models.BPE(unk_token=None, fuse_unk=False, byte_fallback=False))
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(SPLIT_REGEX), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=BPE_VOCAB_SIZE,
        min_frequency=2,
        show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        special_tokens=[],
    )
    tok.train_from_iterator(corpus_documents(), trainer)
    if tok.get_vocab_size() != BPE_VOCAB_SIZE:
        raise RuntimeError(f"BPE learned {tok.get_vocab_size()} tokens, wanted {BPE_VOCAB_SIZE}")
    # Added one by one so that ids follow ADDED_TOKENS order.
    for content, special in ADDED_TOKENS:
        token = AddedToken(content, special=special, normalized=False)
        (tok.add_special_tokens if special else tok.add_tokens)([token])
    ids = {t: tok.token_to_id(t) for t, _ in ADDED_TOKENS}
    if ids != TOKEN_IDS:
        raise RuntimeError(f"added token ids {ids} differ from {TOKEN_IDS}")
    return tok


@functools.lru_cache(maxsize=1)
def tokenizer_json() -> str:
    """The trained tokenizer as ``tokenizer.json`` text; trained once per process."""
    return train_tokenizer().to_str(pretty=True)


def tokenizer_config(model_max_length: int) -> dict:
    """``tokenizer_config.json`` for the trained tokenizer (Qwen2Tokenizer, as Qwen3 ships)."""
    added = {
        str(TOKEN_IDS[content]): {
            "content": content,
            "lstrip": False,
            "normalized": False,
            "rstrip": False,
            "single_word": False,
            "special": special,
        }
        for content, special in ADDED_TOKENS
    }
    return {
        "add_bos_token": False,
        "add_prefix_space": False,
        "added_tokens_decoder": added,
        "bos_token": BOS_TOKEN,
        "chat_template": CHAT_TEMPLATE,
        "clean_up_tokenization_spaces": False,
        "eos_token": EOS_TOKEN,
        "errors": "replace",
        "model_max_length": model_max_length,
        "pad_token": PAD_TOKEN,
        "split_special_tokens": False,
        "tokenizer_class": "Qwen2Tokenizer",
        "unk_token": None,
    }


def write_tokenizer(out: Path, model_max_length: int) -> None:
    """Write ``tokenizer.json`` and ``tokenizer_config.json`` into ``out``."""
    (out / "tokenizer.json").write_text(tokenizer_json(), encoding="utf-8")
    config = tokenizer_config(model_max_length)
    (out / "tokenizer_config.json").write_text(
        json.dumps(config, indent=2, ensure_ascii=False) + "\n", encoding="utf-8"
    )
