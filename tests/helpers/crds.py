"""JSON schemas of the three custom resources our Kubernetes example uses, written from their v1
API references, for ``tests/unit/test_deploy.py``.

kubernetes-validate ships the built-in kinds' schemas (Deployment, Service, RBAC, ...) but no
custom resource's, so these are ours: the fields the v1 APIs define, their required fields, enums
and bounds, and ``additionalProperties: false`` at every level, so a misspelt or misplaced field
fails. They cover what the APIs allow, not only what our manifests use. Sources:

- ``InferencePool`` (``inference.networking.k8s.io/v1``): the Gateway API Inference Extension's
  API reference (site-src/reference/spec.md of kubernetes-sigs/gateway-api-inference-extension);
- ``Gateway`` and ``HTTPRoute`` (``gateway.networking.k8s.io/v1``): the Gateway API reference
  (standard channel).
"""

from __future__ import annotations

_DNS_SUBDOMAIN = r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$"
_DNS_LABEL = r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$"
_GROUP = {"type": "string", "maxLength": 253, "pattern": r"^$|" + _DNS_SUBDOMAIN}
_KIND = {
    "type": "string",
    "minLength": 1,
    "maxLength": 63,
    "pattern": r"^[a-zA-Z]([-a-zA-Z0-9]*[a-zA-Z0-9])?$",
}
_NAME = {"type": "string", "minLength": 1, "maxLength": 253}
_NAMESPACE = {"type": "string", "minLength": 1, "maxLength": 63, "pattern": _DNS_LABEL}
_PORT_NUMBER = {"type": "integer", "minimum": 1, "maximum": 65535}
_SECTION_NAME = {"type": "string", "minLength": 1, "maxLength": 253, "pattern": _DNS_SUBDOMAIN}
_DURATION = {"type": "string", "pattern": r"^([0-9]{1,5}(h|m|s|ms)){1,4}$"}
_LABEL_VALUE = {
    "type": "string",
    "maxLength": 63,
    "pattern": r"^(([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9])?$",
}
_LABEL_KEY = r"^([a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*/)?([A-Za-z0-9][-A-Za-z0-9_.]{0,61})?[A-Za-z0-9]$"


def _obj(properties: dict, required: tuple[str, ...] = ()) -> dict:
    return {
        "type": "object",
        "properties": properties,
        "required": list(required),
        "additionalProperties": False,
    }


def _resource(api_version: str, kind: str, spec: dict) -> dict:
    metadata = {
        "type": "object",
        "properties": {
            "name": {"type": "string", "maxLength": 253, "pattern": _DNS_SUBDOMAIN},
            "namespace": _NAMESPACE,
            "labels": {"type": "object", "additionalProperties": {"type": "string"}},
            "annotations": {"type": "object", "additionalProperties": {"type": "string"}},
        },
        "required": ["name"],
        "additionalProperties": False,
    }
    return _obj(
        {
            "apiVersion": {"const": api_version},
            "kind": {"const": kind},
            "metadata": metadata,
            "spec": spec,
        },
        ("apiVersion", "kind", "metadata", "spec"),
    )


_PORT = _obj({"number": _PORT_NUMBER}, ("number",))

INFERENCE_POOL = _resource(
    "inference.networking.k8s.io/v1",
    "InferencePool",
    _obj(
        {
            "selector": _obj(
                {
                    "matchLabels": {
                        "type": "object",
                        "minProperties": 1,
                        "maxProperties": 64,
                        "propertyNames": {"pattern": _LABEL_KEY, "maxLength": 253},
                        "additionalProperties": _LABEL_VALUE,
                    }
                },
                ("matchLabels",),
            ),
            "targetPorts": {"type": "array", "minItems": 1, "maxItems": 1, "items": _PORT},
            "endpointPickerRef": _obj(
                {
                    "group": _GROUP,
                    "kind": _KIND,
                    "name": _NAME,
                    "port": _PORT,
                    "failureMode": {"enum": ["FailOpen", "FailClose"]},
                },
                ("name",),
            ),
        },
        ("selector", "targetPorts", "endpointPickerRef"),
    ),
)

GATEWAY = _resource(
    "gateway.networking.k8s.io/v1",
    "Gateway",
    _obj(
        {
            "gatewayClassName": _NAME,
            "listeners": {
                "type": "array",
                "minItems": 1,
                "maxItems": 64,
                "items": _obj(
                    {
                        "name": _SECTION_NAME,
                        "hostname": {"type": "string", "maxLength": 253},
                        "port": _PORT_NUMBER,
                        "protocol": {"type": "string", "minLength": 1, "maxLength": 255},
                        "tls": {"type": "object"},
                        "allowedRoutes": {"type": "object"},
                    },
                    ("name", "port", "protocol"),
                ),
            },
            "addresses": {"type": "array", "maxItems": 16},
            "infrastructure": {"type": "object"},
        },
        ("gatewayClassName", "listeners"),
    ),
)

_PARENT_REF = _obj(
    {
        "group": _GROUP,
        "kind": _KIND,
        "namespace": _NAMESPACE,
        "name": _NAME,
        "sectionName": _SECTION_NAME,
        "port": _PORT_NUMBER,
    },
    ("name",),
)
_BACKEND_REF = _obj(
    {
        "group": _GROUP,
        "kind": _KIND,
        "name": _NAME,
        "namespace": _NAMESPACE,
        "port": _PORT_NUMBER,
        "weight": {"type": "integer", "minimum": 0, "maximum": 1000000},
        "filters": {"type": "array", "maxItems": 16},
    },
    ("name",),
)
_MATCH = _obj(
    {
        "path": _obj(
            {
                "type": {"enum": ["Exact", "PathPrefix", "RegularExpression"]},
                "value": {"type": "string", "maxLength": 1024},
            }
        ),
        "headers": {"type": "array", "maxItems": 16},
        "queryParams": {"type": "array", "maxItems": 16},
        "method": {"enum": ["GET", "HEAD", "POST", "PUT", "DELETE", "CONNECT", "OPTIONS", "TRACE", "PATCH"]},
    }
)

HTTP_ROUTE = _resource(
    "gateway.networking.k8s.io/v1",
    "HTTPRoute",
    _obj(
        {
            "parentRefs": {"type": "array", "maxItems": 32, "items": _PARENT_REF},
            "hostnames": {"type": "array", "maxItems": 16, "items": {"type": "string"}},
            "rules": {
                "type": "array",
                "maxItems": 16,
                "items": _obj(
                    {
                        "name": _SECTION_NAME,
                        "matches": {"type": "array", "maxItems": 64, "items": _MATCH},
                        "filters": {"type": "array", "maxItems": 16},
                        "backendRefs": {"type": "array", "maxItems": 16, "items": _BACKEND_REF},
                        "timeouts": _obj({"request": _DURATION, "backendRequest": _DURATION}),
                        "retry": {"type": "object"},
                        "sessionPersistence": {"type": "object"},
                    }
                ),
            },
        }
    ),
)

SCHEMAS = {
    ("inference.networking.k8s.io/v1", "InferencePool"): INFERENCE_POOL,
    ("gateway.networking.k8s.io/v1", "Gateway"): GATEWAY,
    ("gateway.networking.k8s.io/v1", "HTTPRoute"): HTTP_ROUTE,
}
