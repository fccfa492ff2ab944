"""Builds nvidia.com_dynamographdeployments.v1beta1.yaml (see README.md in this folder).

The DynamoGraphDeployment-specific part of the v1beta1 openAPIV3Schema is transcribed in
SKELETON below from ai-dynamo/dynamo's generated CRD; the Kubernetes types the CRD embeds
(corev1.PodSpec under podTemplate.spec, corev1.EnvVar under spec.env) are expanded from the
Kubernetes 1.35 OpenAPI definitions bundled with kubernetes-validate, in the form controller-gen
writes them (refs inlined, quantities as int-or-string, descriptions dropped).

    .venv/bin/python tests/data/dynamo/build_dgd_crd.py   # rewrites the YAML next to it
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import yaml

HERE = Path(__file__).resolve().parent
OUT = HERE / "nvidia.com_dynamographdeployments.v1beta1.yaml"
K8S = "v1.35.0-local-strict"
SOURCE = ("ai-dynamo/dynamo deploy/operator/config/crd/bases/nvidia.com_dynamographdeployments.yaml"
          " @ 01cc1c3b677b20c5dd72d9eb76962dc04b55b8be")
QUANTITY = (r"^(\+|-)?(([0-9]+(\.[0-9]*)?)|(\.[0-9]+))"
            r"(([KMGTPE]i)|[numkMGTPE]|([eE](\+|-)?(([0-9]+(\.[0-9]*)?)|(\.[0-9]+))))?$")
DNS_LABEL = r"^[a-z0-9]([a-z0-9-]*[a-z0-9])?$"
STR = {"type": "string"}
STR_MAP = {"type": "object", "additionalProperties": {"type": "string"}}
# Fields of the CRD that this chart never renders are kept by name with their type only and
# `x-dtkv-abbreviated: true` (their inner schema was not transcribed).
ABBREVIATED = {"type": "object", "x-kubernetes-preserve-unknown-fields": True, "x-dtkv-abbreviated": True}

COMPONENT = {
    "type": "object",
    "required": ["name"],
    "properties": {
        "compilationCache": {"type": "object", "required": ["pvcName"],
                             "properties": {"mountPath": STR, "pvcName": {"type": "string", "minLength": 1}}},
        "eppConfig": ABBREVIATED,
        "experimental": ABBREVIATED,  # checkpoint, failover, gpuMemoryService
        "frontendSidecar": STR,
        "globalDynamoNamespace": {"type": "boolean"},
        "minAvailable": {"type": "integer", "format": "int32", "minimum": 1},
        "modelRef": {"type": "object", "required": ["name"],
                     "properties": {"name": {"type": "string", "minLength": 1}, "revision": STR}},
        "multinode": {"type": "object", "properties": {
            "nodeCount": {"type": "integer", "format": "int32", "minimum": 2, "default": 2}}},
        "name": {"type": "string", "minLength": 1, "maxLength": 63,
                 "pattern": r"^[A-Za-z0-9]([-A-Za-z0-9]*[A-Za-z0-9])?$"},
        "podTemplate": {"type": "object", "properties": {
            "metadata": {"type": "object", "properties": {
                "annotations": {"type": "object", "additionalProperties": {"type": "string", "maxLength": 262144}},
                "finalizers": {"type": "array", "items": STR},
                "labels": STR_MAP, "name": STR, "namespace": STR}},
            "spec": {"$k8s": "io.k8s.api.core.v1.PodSpec", "required": ["containers"]}}},
        "replicas": {"type": "integer", "format": "int32", "minimum": 0},
        "runtimeVersionOverride": {"type": "string",
                                   "pattern": r"^(0|[1-9][0-9]{0,3})\.(0|[1-9][0-9]{0,3})\.(0|[1-9][0-9]{0,3})$"},
        "scalingAdapter": ABBREVIATED,
        "sharedMemorySize": {"anyOf": [{"type": "integer"}, {"type": "string"}], "pattern": QUANTITY,
                             "x-kubernetes-int-or-string": True},
        "topologyConstraint": {"type": "object", "required": ["packDomain"],
                               "properties": {"packDomain": {"type": "string", "pattern": DNS_LABEL}}},
        "type": {"type": "string", "enum": ["frontend", "worker", "prefill", "decode", "planner", "epp"]},
    },
    # CEL rules of the CRD (not evaluated by jsonschema; tests check the ones that matter here)
    "x-kubernetes-validations": [
        {"message": "eppConfig may only be set when type is epp",
         "rule": "!has(self.eppConfig) || (has(self.type) && self.type == 'epp')"}],
}

SKELETON = {
    "type": "object",
    "properties": {
        "apiVersion": STR,
        "kind": STR,
        "metadata": {"type": "object"},
        "spec": {"type": "object", "properties": {
            "annotations": STR_MAP,
            "backendFramework": {"type": "string", "enum": ["sglang", "vllm", "trtllm"]},
            "components": {
                "type": "array", "maxItems": 25, "items": COMPONENT,
                "x-kubernetes-list-type": "map", "x-kubernetes-list-map-keys": ["name"],
                "x-kubernetes-validations": [
                    {"message": "at most one component may have type epp",
                     "rule": "self.filter(c, has(c.type) && c.type == 'epp').size() <= 1"},
                    {"message": "component names must be unique case-insensitively",
                     "rule": "self.all(c1, !has(c1.name) || self.filter(c2, has(c2.name) && "
                             "c2.name.lowerAscii() == c1.name.lowerAscii()).size() == 1)"}]},
            "env": {"type": "array", "items": {"$k8s": "io.k8s.api.core.v1.EnvVar"}},
            "experimental": ABBREVIATED,  # kvTransferPolicy
            "labels": STR_MAP,
            "priorityClassName": STR,
            "restart": {"type": "object", "required": ["id"], "properties": {
                "id": {"type": "string", "minLength": 1},
                "strategy": {"type": "object", "properties": {
                    "order": {"type": "array", "items": STR},
                    "type": {"type": "string", "enum": ["Sequential", "Parallel"], "default": "Sequential"}}}}},
            "topologyConstraint": {"type": "object", "required": ["clusterTopologyName"], "properties": {
                "clusterTopologyName": {"type": "string", "minLength": 1},
                "packDomain": {"type": "string", "pattern": DNS_LABEL}}},
        }},
        "status": ABBREVIATED,
    },
}


def _k8s_defs() -> dict[str, Any]:
    import kubernetes_validate

    path = Path(os.path.dirname(kubernetes_validate.__file__)) / "kubernetes-json-schema" / K8S / "_definitions.json"
    return json.loads(path.read_text())["$defs"]


def _crd_form(schema: Any, defs: dict[str, Any]) -> Any:
    """A Kubernetes JSON schema in the structural form a CRD carries."""
    if isinstance(schema, list):
        return [_crd_form(s, defs) for s in schema]
    if not isinstance(schema, dict):
        return schema
    ref = schema.get("$ref")
    if ref:
        name = ref.rsplit("/", 1)[-1]
        if name in ("io.k8s.apimachinery.pkg.api.resource.Quantity",):
            return {"anyOf": [{"type": "integer"}, {"type": "string"}], "pattern": QUANTITY,
                    "x-kubernetes-int-or-string": True}
        if name == "io.k8s.apimachinery.pkg.util.intstr.IntOrString":
            return {"anyOf": [{"type": "integer"}, {"type": "string"}], "x-kubernetes-int-or-string": True}
        if name == "io.k8s.apimachinery.pkg.apis.meta.v1.ObjectMeta":
            return {"type": "object"}  # nested metadata (ephemeral volume claim templates): as controller-gen
        return _crd_form(defs[name], defs)
    out: dict[str, Any] = {}
    for k, v in schema.items():
        if k in ("description", "additionalProperties") and not (k == "additionalProperties" and isinstance(v, dict)):
            continue
        if k == "type" and isinstance(v, list):
            v = next(t for t in v if t != "null")
        out[k] = {name: _crd_form(p, defs) for name, p in v.items()} if k == "properties" else _crd_form(v, defs)
    return out


def _expand(node: Any, defs: dict[str, Any]) -> Any:
    if isinstance(node, list):
        return [_expand(n, defs) for n in node]
    if not isinstance(node, dict):
        return node
    if "$k8s" in node:
        expanded = _crd_form({"$ref": "#/$defs/" + node["$k8s"]}, defs)
        for k, v in node.items():
            if k != "$k8s":
                expanded[k] = v
        return expanded
    return {k: _expand(v, defs) for k, v in node.items()}


def build() -> dict[str, Any]:
    schema = _expand(SKELETON, _k8s_defs())
    return {
        "apiVersion": "apiextensions.k8s.io/v1",
        "kind": "CustomResourceDefinition",
        "metadata": {"name": "dynamographdeployments.nvidia.com",
                     "annotations": {"dtkv/source": SOURCE, "dtkv/embedded-k8s-types": K8S}},
        "spec": {"group": "nvidia.com", "scope": "Namespaced",
                 "names": {"kind": "DynamoGraphDeployment", "listKind": "DynamoGraphDeploymentList",
                           "plural": "dynamographdeployments", "singular": "dynamographdeployment",
                           "shortNames": ["dgd"]},
                 "versions": [{"name": "v1beta1", "served": True, "storage": True,
                               "schema": {"openAPIV3Schema": schema}, "subresources": {"status": {}}}]},
    }


if __name__ == "__main__":
    header = ("# GENERATED by build_dgd_crd.py; see README.md for the source and what was abbreviated.\n"
              f"# Source: {SOURCE} (version v1beta1)\n")
    OUT.write_text(header + yaml.safe_dump(build(), sort_keys=True, width=200))
    print(OUT, OUT.stat().st_size)
