"""In-process engines for the tests that compare a GGUF file with the folder it was converted
from: one float32 CPU engine per model path, kept for the module (their weights are a few MB),
and greedy decoding that also returns the logits each token was picked from."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch

from pantheon.core.protocol import SamplingParams
from workers.engine import Engine


class Engines:
    """``engines(path)``: the module's engine for ``path``, made on first use. A test module
    holds one and exposes ``engines.fixture()`` so that they close when the module ends."""

    def __init__(self) -> None:
        self._by_path: dict[str, Engine] = {}

    def __call__(self, path: Path | str) -> Engine:
        key = str(path)
        if key not in self._by_path:
            self._by_path[key] = Engine(key, dtype="float32")
        return self._by_path[key]

    def close(self) -> None:
        for e in self._by_path.values():
            e.close()
        self._by_path.clear()

    def fixture(self) -> Callable[[], Iterator[None]]:
        """A module-scoped autouse fixture closing these engines (assign it to a module name)."""

        @pytest.fixture(scope="module", autouse=True)
        def _close_engines() -> Iterator[None]:
            yield
            self.close()

        return _close_engines


def greedy(eng: Engine, prompt: list[int], n: int) -> tuple[list[int], torch.Tensor]:
    """``n`` greedy tokens and the logits each was picked from ([n, vocab])."""
    rows: list[torch.Tensor] = []
    eng.on_logits = lambda _seqs, logits: rows.append(logits[0].clone())
    try:
        eng.submit("g", prompt, SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True))
        out: list[int] = []
        while eng.has_work():
            out += [o.token for o in eng.step()]
    finally:
        eng.on_logits = None
    return out, torch.stack(rows)


def assert_same_logits(
    file: Engine, folder: Engine, prompt: list[int], vocab: int, steps: int, tol: float
) -> None:
    """A converted file's engine gives its folder's logits: over the prompt (prefill) and over
    ``steps`` greedy decode steps, within ``tol``, the same tokens. The folder's logits are cut
    to the file's ``vocab`` (a folder may pad its table past the tokenizer's ids)."""
    want = folder.prompt_logits(prompt)[:, :vocab]
    got = file.prompt_logits(prompt)
    assert got.shape == want.shape == (len(prompt), vocab)
    assert (got - want).abs().max().item() < tol
    got_tokens, got_rows = greedy(file, prompt, steps)
    want_tokens, want_rows = greedy(folder, prompt, steps)
    assert got_tokens == want_tokens and len(got_tokens) == steps
    assert (got_rows - want_rows[:, :vocab]).abs().max().item() < tol
