"""The examples in ``deploy/``: the Kubernetes manifests validate against their schemas and hang
together, and LiteLLM's config describes one model group over two routers.

Built-in kinds are checked by kubernetes-validate (the Kubernetes OpenAPI schemas, strict: unknown
fields fail); the Inference Extension's and Gateway API's custom resources by the schemas in
``helpers/crds.py``. Each validator is also shown a broken copy, so a test that cannot fail is
caught. Whether the EPP's metric names are what a live router exports is checked in
``tests/e2e/test_gateway.py``; the LiteLLM config is run for real there too.
"""

from __future__ import annotations

import copy
import re

import jsonschema
import kubernetes_validate
import pytest
import yaml

from helpers.crds import SCHEMAS
from helpers.deploy import DEPLOY, K8S, args_of, epp_metric_specs, find, manifests

K8S_VERSION = "1.33"  # a release every maintained Gateway API Inference Extension supports


def validate(doc: dict) -> None:
    """Raise when ``doc`` breaks its kind's schema (or no schema knows its kind)."""
    schema = SCHEMAS.get((doc["apiVersion"], doc["kind"]))
    if schema is not None:
        jsonschema.Draft202012Validator(schema).validate(doc)
    else:
        kubernetes_validate.validate(doc, K8S_VERSION, strict=True)


@pytest.mark.parametrize("name,doc", manifests(), ids=lambda x: x if isinstance(x, str) else x["kind"])
def test_every_manifest_validates_against_its_schema(name, doc):
    validate(doc)


@pytest.mark.parametrize(
    "kind,break_it",
    [
        ("InferencePool", lambda d: d["spec"].update(targetPortNumber=8000)),  # the v1alpha2 field
        ("InferencePool", lambda d: d["spec"]["targetPorts"].append({"number": 8001})),  # max 1
        ("HTTPRoute", lambda d: d["spec"]["rules"][0]["matches"][0]["path"].update(type="Prefix")),
        ("Gateway", lambda d: d["spec"]["listeners"][0].pop("port")),
        ("Deployment", lambda d: d["spec"]["template"]["spec"]["containers"][0].update(ports="8000")),
        ("Service", lambda d: d["spec"].update(selectors={"app": "pantheon"})),
    ],
)
def test_a_broken_manifest_fails(kind, break_it):
    doc = copy.deepcopy([d for _, d in manifests() if d["kind"] == kind][0])
    validate(doc)
    break_it(doc)
    with pytest.raises((jsonschema.ValidationError, kubernetes_validate.ValidationError)):
        validate(doc)


def test_the_kustomization_lists_every_manifest():
    k = yaml.safe_load((K8S / "kustomization.yaml").read_text())
    files = {f.name for f in K8S.glob("*.yaml")} - {"kustomization.yaml"}
    assert sorted(k["resources"]) == sorted(files)


def test_the_pool_selects_the_pantheon_pods_on_their_port():
    pool, dep = find("InferencePool"), find("Deployment", "pantheon")
    pod = dep["spec"]["template"]
    labels = pod["metadata"]["labels"]
    assert pool["spec"]["selector"]["matchLabels"].items() <= labels.items()
    assert dep["spec"]["selector"]["matchLabels"].items() <= labels.items()
    (c,) = pod["spec"]["containers"]
    port = pool["spec"]["targetPorts"][0]["number"]
    assert port in [p["containerPort"] for p in c["ports"]]
    assert c["readinessProbe"]["httpGet"] == {"path": "/health", "port": port}
    assert args_of(c)["port"] == str(port) and args_of(c)["host"] == "0.0.0.0"
    # the pod outlives its drain, or Kubernetes kills requests the router was finishing
    assert pod["spec"]["terminationGracePeriodSeconds"] > int(args_of(c)["drain-timeout"])
    svc = find("Service", "pantheon")
    assert svc["spec"]["selector"].items() <= labels.items()


def test_the_pool_and_its_endpoint_picker_point_at_each_other():
    pool = find("InferencePool")
    ref = pool["spec"]["endpointPickerRef"]
    svc, dep = find("Service", ref["name"]), find("Deployment", ref["name"])
    assert ref["port"]["number"] in [p["port"] for p in svc["spec"]["ports"]]
    pod = dep["spec"]["template"]
    assert svc["spec"]["selector"].items() <= pod["metadata"]["labels"].items()
    (epp,) = pod["spec"]["containers"]
    flags = args_of(epp)
    assert flags["pool-name"] == pool["metadata"]["name"]
    assert flags["grpc-port"] == str(ref["port"]["number"])
    # its service account may read pools and pods
    sa = pod["spec"]["serviceAccountName"]
    find("ServiceAccount", sa)
    binding = find("RoleBinding")
    assert {"kind": "ServiceAccount", "name": sa} in binding["subjects"]
    role = find("Role", binding["roleRef"]["name"])
    granted = {(g, r) for rule in role["rules"] for g in rule["apiGroups"] for r in rule["resources"]}
    assert {("inference.networking.k8s.io", "inferencepools"), ("", "pods")} <= granted
    # its config file is a key of the mounted ConfigMap, and every profile names declared plugins
    (mount,) = epp["volumeMounts"]
    (vol,) = [v for v in pod["spec"]["volumes"] if v["name"] == mount["name"]]
    key = flags["config-file"].removeprefix(mount["mountPath"] + "/")
    cfg = yaml.safe_load(find("ConfigMap", vol["configMap"]["name"])["data"][key])
    assert cfg["kind"] == "EndpointPickerConfig"
    declared = {p["type"] for p in cfg["plugins"]}
    for profile in cfg["schedulingProfiles"]:
        assert {p["pluginRef"] for p in profile["plugins"]} <= declared


def test_the_route_sends_the_gateway_to_the_pool():
    route, gw, pool = find("HTTPRoute"), find("Gateway"), find("InferencePool")
    assert [p["name"] for p in route["spec"]["parentRefs"]] == [gw["metadata"]["name"]]
    (rule,) = route["spec"]["rules"]
    assert rule["backendRefs"] == [
        {"group": "inference.networking.k8s.io", "kind": "InferencePool", "name": pool["metadata"]["name"]}
    ]


def test_the_endpoint_picker_reads_the_series_it_needs():
    specs = epp_metric_specs()
    assert {k: v[0] for k, v in specs.items()} == {
        "total-queued-requests-metric": "vllm:num_requests_waiting",
        "total-running-requests-metric": "vllm:num_requests_running",
        "kv-cache-usage-percentage-metric": "vllm:kv_cache_usage_perc",
        "cache-info-metric": "vllm:cache_config_info",
    }
    # each pinned to the model the pods serve (a router may serve several)
    assert {tuple(v[1].items()) for v in specs.values()} == {(("model_name", "smollm2-135m-instruct"),)}


def test_litellm_config_is_one_model_group_over_two_routers():
    cfg = yaml.safe_load((DEPLOY / "litellm" / "config.yaml").read_text())
    entries = cfg["model_list"]
    assert len(entries) == 2 and len({e["model_name"] for e in entries}) == 1
    bases = [e["litellm_params"]["api_base"] for e in entries]
    assert bases == ["os.environ/PANTHEON_A", "os.environ/PANTHEON_B"]
    for e in entries:  # LiteLLM's vLLM provider, asking for the name the routers serve
        assert e["litellm_params"]["model"] == "hosted_vllm/" + e["model_name"]
    assert cfg["router_settings"]["routing_strategy"] == "least-busy"
    assert cfg["router_settings"]["num_retries"] >= 1  # a draining router's 503 is retried elsewhere
    # the proxy that runs it is pinned to one release, never a range
    (req,) = [
        x for x in (DEPLOY / "litellm" / "requirements.txt").read_text().splitlines() if x[:1].isalpha()
    ]
    assert re.fullmatch(r"litellm\[proxy\]==[0-9]+(\.[0-9]+)+", req), req
