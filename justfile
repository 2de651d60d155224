# Pantheon's everyday commands. `just --list` shows them.

python := env_var_or_default("PYTHON", "python3")

# install the CPU torch build first (a plain `torch` would pull a multi-GB CUDA build), then us
install:
    {{python}} -m pip install torch==2.13.0
    {{python}} -m pip install -e '.[dev]'

# start the router on the built-in default model (or pass flags: just serve --model DIR)
serve *ARGS:
    {{python}} -m pantheon serve {{ARGS}}

# the whole test suite (CPU; GPU-only tests skip without CUDA)
test *ARGS:
    {{python}} -m pytest -q {{ARGS}}

# decode and serving benchmarks (figures go in the issue notes)
bench *ARGS:
    {{python}} bench/decode.py {{ARGS}}

bench-serve *ARGS:
    {{python}} bench/serve.py {{ARGS}}

# build llama.cpp's llama-server and llama-bench once (~/.cache/pantheon/llama.cpp; LLAMA_CPP_CACHE)
peer:
    {{python}} bench/peer.py build

# against llama.cpp on the same GGUF file (SmolLM2-135M Q4_1 by default; --model F.gguf, --json OUT)
bench-peer *ARGS:
    {{python}} bench/decode.py --peer {{ARGS}}

# write a random-weight model folder: just make-model tiny /tmp/tiny
make-model PRESET OUT:
    {{python}} -m pantheon make-model --preset {{PRESET}} --out {{OUT}}

# on a machine with a CUDA device: the correctness tests on cuda:0, then the decode benchmark
gpu-check:
    {{python}} bench/gpu_check.py
    {{python}} -m pytest -q -m gpu tests/unit/test_gpu.py
    {{python}} -m pytest -q tests/unit/test_engine_reference.py tests/unit/test_engine_batching.py
    {{python}} bench/decode.py --device cuda:0 --batches 1,8,32 --tokens 64 --quantize
