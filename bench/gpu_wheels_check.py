"""Is the set of carried wheels complete? Each wheel's ``Requires-Dist`` (markers evaluated for the
device's CPython 3.12 on Linux x86_64, extras left out) must be met by another carried wheel (the
version checked) or by a package the device image holds (its name in KINDS.md's list; the version
can only be checked there).

    python3 bench/gpu_wheels_check.py .whl          # here, from the wheels' METADATA
    python3 bench/gpu_wheels_check.py --installed /tmp/site   # on the device, after the install:
                                                    # every requirement against what imports there

Prints one line per unmet or unverifiable requirement and a summary; the exit status is the number
of unmet ones (a name neither carried nor in the image's list, a carried version out of range,
two versions of one name).
"""

from __future__ import annotations

import argparse
import re
import sys
import zipfile
from email.parser import Parser
from pathlib import Path

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
from packaging.version import Version

# KINDS.md, "Python packages already there" (the 'cuda' image, read 2026-11-17)
IMAGE = """absl-py accelerate aiofiles aiohappyeyeballs aiohttp aiosignal annotated-doc anyio attrs botorch
build certifi charset-normalizer chex click cloudpickle cmake colorama contourpy coverage cuda-bindings
cuda-core cuda-pathfinder cuda-toolkit cupy-cuda13x cycler cython diffrax e3nn einops equinox etils
execnet filelock flatbuffers flax fonttools formulaic frozenlist fsspec gpytorch grpcio h11 h5py hf-xet
httpcore httpx huggingface-hub humanize hypothesis idna imageio iniconfig interface-meta jax
jax-cuda13-pjrt jax-cuda13-plugin jaxlib jaxtyping jinja2 joblib kiwisolver lazy-loader lightning
lightning-utilities linear-operator lineax llvmlite lxml markdown markdown-it-py markupsafe matplotlib
mdurl meson ml-dtypes mpi4py mpmath msgpack multidict multipledispatch mypy-extensions nanobind narwhals
networkx ninja numba numba-cuda numpy numpyro nvidia-cublas nvidia-cuda-cupti nvidia-cuda-nvrtc
nvidia-cuda-runtime nvidia-cudnn-cu13 nvidia-cufft nvidia-cufile nvidia-curand nvidia-cusolver
nvidia-cusparse nvidia-cusparselt-cu13 nvidia-ml-py nvidia-nccl-cu13 nvidia-nvjitlink
nvidia-nvshmem-cu13 nvidia-nvtx onnx onnx-ir onnxruntime onnxscript opencv-python-headless optax
opt-einsum opt-einsum-fx optimistix orbax-checkpoint packaging pandas pathspec patsy peft pillow pip
pluggy portalocker prometheus-client propcache protobuf psutil pyarrow pybind11 py-cpuinfo pygments
pyparsing pyproject-hooks pyre-extensions pytest pytest-benchmark pytest-cov pytest-mock pytest-timeout
pytest-xdist python-dateutil pytorch-lightning pyyaml regex requests rich sacrebleu safetensors
scikit-build-core scikit-image scikit-learn scipy seaborn sentencepiece sentence-transformers
setuptools shellingham simplejson six sortedcontainers statsmodels sympy tabulate tensorboard
tensorboard-data-server tensorstore threadpoolctl tifffile tiktoken timm tokenizers toolz torch
torchaudio torchdiffeq torch-geometric torchmetrics torchvision tqdm transformers treescope triton
typer typing-extensions typing-inspect urllib3 uvloop wadler-lindig werkzeug wheel wrapt xarray
xxhash yarl zipp""".split()

# the device's interpreter and platform, for the requirements' markers
ENV = {
    "python_version": "3.12",
    "python_full_version": "3.12.3",
    "implementation_name": "cpython",
    "platform_python_implementation": "CPython",
    "sys_platform": "linux",
    "platform_system": "Linux",
    "platform_machine": "x86_64",
    "os_name": "posix",
    "extra": "",
}


def wheel_metadata(path: Path) -> tuple[str, Version, list[str]]:
    with zipfile.ZipFile(path) as z:
        name = next(n for n in z.namelist() if re.fullmatch(r"[^/]+\.dist-info/METADATA", n))
        meta = Parser().parsestr(z.read(name).decode())
    return meta["Name"], Version(meta["Version"]), meta.get_all("Requires-Dist") or []


def installed_metadata(site: Path) -> list[tuple[str, Version, list[str]]]:
    from importlib import metadata

    out = []
    for d in metadata.distributions(path=[str(site)]):
        out.append((d.metadata["Name"], Version(d.version), d.requires or []))
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("where", help="a folder of wheels, or with --installed the --target folder")
    ap.add_argument("--installed", action="store_true", help="check what is installed (on the device)")
    args = ap.parse_args()
    where = Path(args.where)
    if args.installed:
        dists = installed_metadata(where)
    else:
        dists = [wheel_metadata(p) for p in sorted(where.glob("*.whl"))]
    carried: dict[str, Version] = {}
    bad = 0
    for name, version, _ in dists:
        key = canonicalize_name(name)
        if key in carried:
            print(f"TWO VERSIONS  {name}: {carried[key]} and {version}")
            bad += 1
        carried[key] = version
    image = {canonicalize_name(n) for n in IMAGE}
    assumed: set[str] = set()
    for name, version, requires in dists:
        for line in requires:
            req = Requirement(line)
            if req.marker is not None and not req.marker.evaluate(ENV):
                continue  # an extra, or another Python / platform
            key = canonicalize_name(req.name)
            if key in carried:
                if not req.specifier.contains(carried[key], prereleases=True):
                    print(f"UNMET  {name} {version} needs {req}: carried {carried[key]}")
                    bad += 1
            elif args.installed:
                from importlib import metadata

                try:
                    have = Version(metadata.version(req.name))
                except metadata.PackageNotFoundError:
                    print(f"MISSING  {name} {version} needs {req}: not installed here")
                    bad += 1
                    continue
                if not req.specifier.contains(have, prereleases=True):
                    print(f"UNMET  {name} {version} needs {req}: the image has {have}")
                    bad += 1
            elif key in image:
                if req.specifier:
                    assumed.add(f"{req.name}{req.specifier}")
            else:
                print(f"MISSING  {name} {version} needs {req}: neither carried nor in the image's list")
                bad += 1
    print(f"{len(dists)} distributions, {bad} unmet requirement(s)")
    if assumed:
        print("versions only the device can check (the image's): " + ", ".join(sorted(assumed)))
    return bad


if __name__ == "__main__":
    sys.exit(main())
