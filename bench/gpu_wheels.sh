#!/usr/bin/env bash
# The wheels the lent GPU machine lacks, for its python3 (CPython 3.12, manylinux x86_64), into .whl/
# in the repo root: the router (quart, hypercorn and theirs), the worker (pyzmq, msgspec, llguidance,
# gguf, fla-core) and the checks (the official openai client and pydantic). Run here, in the repo root:
#
#     bash bench/gpu_wheels.sh            # downloads, prints each size and the total, checks closure
#
# then the device call names `.whl` in carry (bench/gpu_check.py's docstring has the command).
#
# What the device image already holds (/work/.library/device/KINDS.md, "Python packages already
# there") is not carried, with three exceptions pinned on purpose because our pins need versions the
# image's copy may predate and each is a few hundred KiB: werkzeug (Quart/Flask are tied to its
# minor version), typing-extensions (pydantic-core needs >= 4.14.1) and h11 (wsproto 1.3 and
# httpcore need >= 0.16). The carried copies come first on PYTHONPATH, so they win there.
# openai is 2.x on purpose: 3.x moved to httpx2/httpcore2/truststore, three more packages; 2.x uses
# the image's httpx. torch, triton, transformers, tokenizers, safetensors, numpy, jinja2, psutil,
# prometheus-client, pyyaml, tqdm, anyio, httpx, click, aiofiles, pytest(+timeout) are the image's.
set -euo pipefail
cd "$(git rev-parse --show-toplevel)"
exclude="$(git rev-parse --git-common-dir)/info/exclude"
mkdir -p "$(dirname "$exclude")"
grep -qxF '/.whl/' "$exclude" 2>/dev/null || echo '/.whl/' >>"$exclude"

WHEELS=(
    # router: Quart over Hypercorn
    quart==0.22.0 flask==3.1.3 werkzeug==3.1.8 blinker==1.9.0 itsdangerous==2.2.0
    hypercorn==0.18.0 h11==0.16.0 h2==4.4.1 hpack==4.2.0 hyperframe==6.1.0 priority==2.0.0 wsproto==1.3.2
    # router and worker
    msgspec==0.23.0 pyzmq==27.3.0 llguidance==1.9.1 gguf==0.19.0
    # the checks: the official client
    openai==2.54.0 distro==1.9.0 jiter==0.19.0 sniffio==1.3.1
    pydantic==2.13.4 pydantic-core==2.46.4 typing-inspection==0.4.2 annotated-types==0.7.0
    typing-extensions==4.16.0
    # the worker's Gated DeltaNet kernels on CUDA (workers/kernels/fla_gdn.py; einops is the image's)
    fla-core==0.6.0
)
PLAT=()
for p in manylinux_2_39 manylinux_2_35 manylinux_2_34 manylinux_2_31 manylinux_2_28 manylinux_2_27 \
    manylinux_2_26 manylinux_2_24 manylinux_2_17 manylinux2014 manylinux1; do
    PLAT+=(--platform "${p}_x86_64")
done
rm -rf .whl
mkdir -p .whl
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    "${PLAT[@]}" -d .whl "${WHEELS[@]}"
ls -l .whl | awk 'NR > 1 {printf "%9.0f KiB  %s\n", $5 / 1024, $9}'
du -cb .whl/*.whl | tail -1 | awk '{printf "total %.1f MiB in %d wheels\n", $1 / 1048576, '"${#WHEELS[@]}"'}'
[ "$(ls .whl/*.whl | wc -l)" -eq "${#WHEELS[@]}" ] || { echo "expected ${#WHEELS[@]} wheels" >&2; exit 1; }
python3 bench/gpu_wheels_check.py .whl
