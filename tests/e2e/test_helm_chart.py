"""Every object the Helm chart (helm/tandem) renders, for every value set of tests/unit/test_helm_chart.py,
validated against the Kubernetes schemas (kubernetes-validate) of the chart's minimum and a recent Kubernetes:
in process, but some twenty seconds of schema validation, so not among the unit tests.
"""

from __future__ import annotations

from typing import Any

import kubernetes_validate
import pytest

from tests.unit.test_helm_chart import CRD_KINDS, KUBE_VERSIONS, NAMESPACE, VALUE_SETS, render


@pytest.fixture(scope="module")
def rendered() -> dict[str, list[dict[str, Any]]]:
    return {name: render(values) for name, values in VALUE_SETS.items()}


@pytest.mark.parametrize("name", VALUE_SETS)
def test_every_object_matches_the_kubernetes_schemas(rendered, name):
    objects = rendered[name]
    for obj in objects:
        assert obj["metadata"]["namespace"] == NAMESPACE or obj["kind"] in CRD_KINDS
        if obj["kind"] in CRD_KINDS:
            continue
        for version in KUBE_VERSIONS:
            kubernetes_validate.validate(obj, version, strict=True)
    names = [(o["kind"], o["metadata"]["name"]) for o in objects]
    assert len(names) == len(set(names)), "two objects of one kind share a name"
    assert all(len(n) <= 63 for _, n in names)
