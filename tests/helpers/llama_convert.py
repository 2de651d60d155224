"""llama.cpp's own ``convert_hf_to_gguf.py`` for tests: Hugging Face folders -> GGUF with the real names.

    from helpers.llama_convert import convert, converter_dir
    gguf_path = convert(hf_folder, tmp_path / "model.gguf")          # f32 by default

The converter (with its ``conversion/`` package and ``gguf-py``) is the one vendored in PyPI's
``llama-cpp-python`` sdist that ``bench/peer.py`` pins, downloaded and unpacked on first use by
``bench/peer.py``'s own code into ``$LLAMA_CPP_CACHE`` (default ``~/.cache/pantheon/llama.cpp``).
``LLAMA_CPP_SRC=DIR`` uses a llama.cpp checkout at DIR instead.

It runs in a subprocess, through a small wrapper (``_WRAPPER``) that puts the vendored ``gguf-py``
and the tree itself first on ``sys.path`` (the installed ``gguf`` package may be older) and, when
asked, names the BPE pre-tokenizer: the converter recognizes a pre-tokenizer only by the sha256 of
the token ids it gets for a fixed test string, so our own trained tokenizer (Qwen2's split regex, a
4000-token vocabulary) is unknown to it and it refuses with ``NotImplementedError``. The wrapper
makes that one case return the given name instead (``tokenizer.ggml.pre``); a known hash still
gives the converter's own answer. The Qwen2 / Llama converters try SentencePiece first and fall back to
tokenizer.json on FileNotFoundError (no tokenizer.model), but import ``sentencepiece`` before
looking for the file; the wrapper looks first, so that module is not needed. Nothing on disk is edited.
"""

from __future__ import annotations

import fcntl
import importlib.util
import json
import os
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path

from helpers.paths import REPO_ROOT

PEER = REPO_ROOT / "bench" / "peer.py"

# Run as ``python -c _WRAPPER TREE PRE convert-args...``; PRE "" means: no fallback.
_WRAPPER = r"""
import runpy, sys
tree, pre = sys.argv[1], sys.argv[2]
sys.path[:0] = [tree + "/gguf-py", tree]
import gguf  # the vendored one: it is first on sys.path
assert gguf.__file__.startswith(tree), gguf.__file__
from conversion import base
# Qwen2/Llama's set_vocab tries SentencePiece first and falls back to tokenizer.json on
# FileNotFoundError (no tokenizer.model), but imports sentencepiece before looking for the file.
create_sp = base.TextModel._create_vocab_sentencepiece
def _create_vocab_sentencepiece(self):
    if not (self.dir_model / "tokenizer.model").is_file():
        raise FileNotFoundError(f"File not found: {self.dir_model / 'tokenizer.model'}")
    return create_sp(self)
base.TextModel._create_vocab_sentencepiece = _create_vocab_sentencepiece
if pre:
    original = base.TextModel.get_vocab_base_pre
    def get_vocab_base_pre(self, tokenizer):
        try:
            return original(self, tokenizer)
        except NotImplementedError:
            base.logger.warning("pre-tokenizer not known by hash: named %r by the test wrapper", pre)
            return pre
    base.TextModel.get_vocab_base_pre = get_vocab_base_pre
script = tree + "/convert_hf_to_gguf.py"
sys.argv = [script] + sys.argv[3:]
runpy.run_path(script, run_name="__main__")
"""


class ConvertError(RuntimeError):
    """The converter failed; the message ends with the tail of its output."""


def _peer():
    spec = importlib.util.spec_from_file_location("pantheon_bench_peer_for_tests", PEER)
    assert spec and spec.loader
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def converter_dir() -> Path:
    """The vendored llama.cpp tree holding ``convert_hf_to_gguf.py``, fetched (pip download of the
    sdist) and unpacked on first use; ``$LLAMA_CPP_SRC`` when set."""
    env = os.environ.get("LLAMA_CPP_SRC")
    if env:
        tree = Path(env).expanduser()
    else:
        peer = _peer()
        cache = peer.cache_dir()
        cache.mkdir(parents=True, exist_ok=True)
        with open(cache / ".src.lock", "w") as lock:  # parallel test workers unpack once
            fcntl.flock(lock, fcntl.LOCK_EX)
            tree = peer._source(cache)
    if not (tree / "convert_hf_to_gguf.py").is_file():
        raise FileNotFoundError(f"{tree} has no convert_hf_to_gguf.py")
    return tree


def vocab_suite_dir() -> Path:
    """llama.cpp's vocabulary suite (``models/ggml-vocab-*.gguf`` with their ``.inp``/``.out``), in
    the tree ``converter_dir`` would use; not fetched here: the test fails saying how to get it."""
    import pytest

    env = os.environ.get("LLAMA_CPP_SRC")
    peer = _peer()
    tree = (
        Path(env).expanduser()
        if env
        else peer.cache_dir() / "src" / f"llama_cpp_python-{peer.LLAMA_CPP_PYTHON}" / "vendor" / "llama.cpp"
    )
    models = tree / "models"
    if not any(models.glob("ggml-vocab-*.gguf.inp")):
        pytest.fail(
            f"llama.cpp's vocabulary suite is missing ({models}/ggml-vocab-*.gguf.inp): run "
            "`python3 bench/peer.py source` (downloads the llama-cpp-python sdist it pins, as .ci/run "
            "does) or set LLAMA_CPP_SRC to a llama.cpp checkout"
        )
    return models


VOCAB_SEP = "\n__ggml_vocab_test__\n"


def vocab_cases(gguf: Path) -> list[tuple[str, list[int]]]:
    """A suite vocabulary's cases as ``tests/test-tokenizer-0.cpp`` reads them: the ``.inp`` texts
    (between separator lines) and the ``.out`` ids (one line per text)."""
    texts = Path(f"{gguf}.inp").read_bytes().decode("utf-8").split(VOCAB_SEP)
    outs = Path(f"{gguf}.out").read_text(encoding="utf-8").split("\n")[: len(texts)]
    assert len(outs) == len(texts), gguf
    return [(t, [int(x) for x in o.split()]) for t, o in zip(texts, outs)]


def pre_tokenizer_name(hf_folder: Path) -> str | None:
    """llama.cpp's ``tokenizer.ggml.pre`` name for the folder's ``tokenizer.json``, from its Split
    regex (the names Pantheon's GGUF reader knows, ``pantheon.core.gguf_tokenizer.PRE_TOKENIZERS``);
    None when there is no tokenizer.json or its regex is not one of them."""
    from pantheon.core.gguf_tokenizer import PRE_TOKENIZERS

    path = Path(hf_folder) / "tokenizer.json"
    if not path.is_file():
        return None
    pre = json.loads(path.read_text(encoding="utf-8")).get("pre_tokenizer") or {}
    steps = pre.get("pretokenizers", [pre]) if pre.get("type") == "Sequence" else [pre]
    for step in steps:
        if step.get("type") == "Split":
            regex = (step.get("pattern") or {}).get("Regex")
            # llama.cpp spells the Hub's case-insensitive contractions out, case by case
            regex = (regex or "").replace(
                "(?i:'s|'t|'re|'ve|'m|'ll|'d)", "(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])"
            )
            for name, p in PRE_TOKENIZERS.items():  # the first name for a regex is the canonical one
                if p.splits == (regex,):
                    return name
            return None
        if step.get("type") == "ByteLevel" and step.get("use_regex", True):
            return "gpt2"
    return None


def convert(
    hf_folder: Path,
    out: Path,
    outtype: str = "f32",
    extra_args: Sequence[str] = (),
    *,
    pre: str | None = None,
    timeout: float = 600,
) -> Path:
    """Convert ``hf_folder`` with llama.cpp's converter; the written .gguf path.

    ``out``: the .gguf file to write, or a folder (then ``<folder>/<hf_folder name>-<outtype>.gguf``).
    ``outtype``: f32, f16, bf16, q8_0 (the converter's ``--outtype``). ``extra_args``: more
    converter flags (``--no-mtp``, ``--mmproj``, ...). ``pre``: the pre-tokenizer name to use when
    the converter does not know the tokenizer by hash (default: read from the folder's
    tokenizer.json by ``pre_tokenizer_name``). Raises ``ConvertError`` with the tail of the
    converter's output when it fails."""
    hf_folder, out = Path(hf_folder), Path(out)
    if out.suffix != ".gguf":
        out.mkdir(parents=True, exist_ok=True)
        out = out / f"{hf_folder.name}-{outtype}.gguf"
    out.parent.mkdir(parents=True, exist_ok=True)
    if pre is None:
        pre = pre_tokenizer_name(hf_folder)
    tree = converter_dir()
    cmd = [
        sys.executable,
        "-c",
        _WRAPPER,
        str(tree),
        pre or "",
        str(hf_folder),
        "--outfile",
        str(out),
        "--outtype",
        outtype,
        *extra_args,
    ]
    env = dict(os.environ)
    env.pop("NO_LOCAL_GGUF", None)
    env["PYTHONPATH"] = os.pathsep.join(
        [str(tree / "gguf-py"), str(tree)] + [p for p in [env.get("PYTHONPATH")] if p]
    )
    env.setdefault("OMP_NUM_THREADS", "2")
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)
    if proc.returncode != 0:
        tail = "\n".join((proc.stdout + proc.stderr).splitlines()[-40:])
        raise ConvertError(f"convert_hf_to_gguf.py failed ({proc.returncode}) on {hf_folder}:\n{tail}")
    if not out.is_file():
        raise ConvertError(f"convert_hf_to_gguf.py exited 0 but wrote no {out}:\n{proc.stderr[-4000:]}")
    return out


def with_vocab(gguf_path: Path, vocab: Path, out: Path, chat_template: str | None = None) -> Path:
    """A copy of ``gguf_path`` at ``out`` whose ``tokenizer.*`` metadata is exactly ``vocab``'s (a
    vocabulary-only GGUF such as llama.cpp's ``models/ggml-vocab-*.gguf``: every key with its own
    type), and ``chat_template`` as ``tokenizer.chat_template`` when given. The converter names a
    tokenizer's pre-tokenizer by hashing its output on one text, and Qwen3.5's, whose regex differs
    from Qwen2's only at combining marks, hashes as Qwen2's: copying the keys is what makes the
    file carry the real vocabulary, whatever the converter guessed. Tensors copied as they are,
    by gguf-py's own ``gguf_new_metadata``."""
    import gguf
    from gguf.scripts.gguf_new_metadata import MetadataDetails, copy_with_new_metadata

    src, voc = gguf.GGUFReader(gguf_path), gguf.GGUFReader(vocab)
    new: dict[str, MetadataDetails] = {}
    for f in voc.fields.values():
        if f.name.startswith("tokenizer."):
            kind = f.types[0]
            sub = f.types[-1] if kind == gguf.GGUFValueType.ARRAY else None
            new[f.name] = MetadataDetails(kind, f.contents(), sub_type=sub)
    if chat_template is not None:
        new["tokenizer.chat_template"] = MetadataDetails(gguf.GGUFValueType.STRING, chat_template)
    remove = [name for name in src.fields if name.startswith("tokenizer.") and name not in new]
    arch = src.get_field("general.architecture")
    assert arch is not None, gguf_path
    writer = gguf.GGUFWriter(out, arch=arch.contents(), endianess=src.endianess)
    copy_with_new_metadata(src, writer, new, remove)
    return out
