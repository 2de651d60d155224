"""Random-weight Hugging Face model folders from presets (``pantheon make-model``): dev tooling
for tests and benchmarks, outside the router and the workers.

A folder holds ``config.json``, ``generation_config.json``, ``model.safetensors`` (or shards plus
``model.safetensors.index.json``), ``tokenizer.json`` and ``tokenizer_config.json``, and loads as-is
with transformers' ``AutoModelForCausalLM`` / ``AutoTokenizer`` (a Qwen3.5 VLM folder also with
``Qwen3_5ForConditionalGeneration``, as the Hub's checkpoints). The tokenizer is our small trained
one (``tokenizer_train``) plus the family's markers, or with ``--vocab FILE.gguf`` a real
vocabulary read from a GGUF file (``vocab.RealVocab``).

Layout: ``families/`` holds one module per family (its presets, config builder, tensor spec,
tokenizer markers and chat template; ``families.FAMILIES`` lists them), ``writer`` streams the
seeded weights into safetensors, ``build`` makes the config and the folder, ``cli`` is the
command. Importing it keeps the process free of torch (imported only inside the writer).
"""

from makemodel.build import build_config, make_model, tensor_specs
from makemodel.families import FAMILIES, PRESETS, family_of
from makemodel.family import text_config

__all__ = ["FAMILIES", "PRESETS", "build_config", "family_of", "make_model", "tensor_specs", "text_config"]
