"""The examples in ``deploy/`` read as data: the Kubernetes manifests' resources, one looked up by
kind and name, a container's flags, and the metric series the endpoint picker is told to read.
Shared by tests/unit/test_deploy.py (the manifests) and tests/e2e/test_gateway.py (a live router)."""

from __future__ import annotations

import re

import yaml

from helpers.paths import REPO_ROOT

DEPLOY = REPO_ROOT / "deploy"
K8S = DEPLOY / "kubernetes"


def manifests() -> list[tuple[str, dict]]:
    """(file name, document) for every resource in deploy/kubernetes (not the kustomization)."""
    out = []
    for f in sorted(K8S.glob("*.yaml")):
        if f.name == "kustomization.yaml":
            continue
        out += [(f.name, d) for d in yaml.safe_load_all(f.read_text()) if d is not None]
    return out


def find(kind: str, name: str | None = None) -> dict:
    got = [d for _, d in manifests() if d["kind"] == kind and (name is None or d["metadata"]["name"] == name)]
    assert len(got) == 1, f"expected one {kind} {name or ''}, found {len(got)}"
    return got[0]


def args_of(container: dict) -> dict[str, str]:
    """``--flag value`` pairs of a container's args."""
    a = container["args"]
    return {a[i].removeprefix("--"): a[i + 1] for i in range(len(a) - 1) if a[i].startswith("--")}


METRIC_SPEC = re.compile(r"^(?P<name>[a-zA-Z_:][a-zA-Z0-9_:]*)(\{(?P<labels>[^}]*)\})?$")


def epp_metric_specs() -> dict[str, tuple[str, dict[str, str]]]:
    """The EPP's ``--*-metric`` flags: {flag: (metric name, labels)}; empty flags (off) left out."""
    (epp,) = find("Deployment", "pantheon-epp")["spec"]["template"]["spec"]["containers"]
    out = {}
    for flag, spec in args_of(epp).items():
        if flag.endswith("-metric") and spec:
            m = METRIC_SPEC.match(spec)
            assert m, spec
            labels = dict(kv.split("=", 1) for kv in (m["labels"] or "").split(",") if kv)
            out[flag] = (m["name"], labels)
    return out
