"""What transformers itself renders for a chat template: the reference Pantheon's renderer
(``pantheon.chat.template``) is compared with, byte for byte.

Also where the real templates of other projects are: llama.cpp's ``models/templates/*.jinja``
(the Hub's templates of the models it serves, fetched by its ``scripts/get_chat_template.py``),
from the vendored tree ``helpers.llama_convert.converter_dir`` unpacks.
"""

from __future__ import annotations

import functools
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import datetime
from pathlib import Path
from typing import Any

import pytest


@functools.lru_cache(maxsize=256)
def _tokenizer(template: str, bos: str | None, eos: str | None) -> Any:
    transformers = pytest.importorskip("transformers")
    from tokenizers import Tokenizer, models

    return transformers.PreTrainedTokenizerFast(
        tokenizer_object=Tokenizer(models.BPE()), bos_token=bos, eos_token=eos, chat_template=template
    )


def hf_render(
    template: str, messages, *, tools=None, add_generation_prompt=True, bos="<s>", eos="</s>", **kw
) -> str:
    """``apply_chat_template(tokenize=False)`` of a real fast tokenizer object carrying
    ``template`` and the special tokens ``bos`` and ``eos`` (None: the tokenizer has none), so
    the template sees exactly what transformers gives it. One tokenizer per template, cached."""
    tok = _tokenizer(template, bos, eos)
    return tok.apply_chat_template(
        messages, tools=tools, tokenize=False, add_generation_prompt=add_generation_prompt, **kw
    )


def llama_cpp_templates() -> Path:
    """llama.cpp's ``models/templates`` folder (the vendored tree is fetched on first use; its
    error says how when that fails)."""
    from helpers.llama_convert import converter_dir

    folder = converter_dir() / "models" / "templates"
    if not folder.is_dir():
        raise FileNotFoundError(
            f"{folder} is missing: the llama.cpp tree at {folder.parents[1]} is incomplete"
        )
    return folder


@contextmanager
def frozen_today(day: datetime) -> Iterator[None]:
    """``strftime_now`` in templates gives ``day``, in Pantheon's renderer and in transformers
    alike, so that a template that writes today's date (Llama 3.2's, Mistral Small 3.2's) renders
    the same in both whatever the clock says (and no comparison straddles midnight)."""
    import transformers.utils.chat_template_utils as hf_utils

    import pantheon.chat.template as ours

    class _Day(datetime):
        @classmethod
        def now(cls, tz=None):  # noqa: ARG003 - datetime.now's signature
            return day

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(ours, "datetime", _Day)
        mp.setattr(hf_utils, "datetime", _Day)
        yield
