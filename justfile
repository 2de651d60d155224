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

# on a machine with a CUDA device: issue 30's check (env and ceilings, -m gpu and the device reference
# tests, a real server through the openai client, the decode bench); the table prints last.
# On the lent GPU machine (carry: [".whl"], wheels from `bash bench/gpu_wheels.sh` here):
#   python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 || exit; python3 bench/gpu_check.py --out $OUT --site /tmp/site
gpu-check *ARGS:
    {{python}} bench/gpu_check.py {{ARGS}}

# the wheels the lent GPU machine lacks, into .whl/ (CPython 3.12, manylinux x86_64)
gpu-wheels:
    bash bench/gpu_wheels.sh
