"""The pools' replica bounds as a kustomize strategic-merge patch of their
HorizontalPodAutoscalers (deploy/k8s/base/target.yaml and draft.yaml).

Add the file to an overlay's `patches` (after any patch of the same fields): it sets
minReplicas and maxReplicas of both HPAs and leaves their metrics as they are.
"""

from __future__ import annotations

from dataclasses import dataclass

# The HPAs' names in deploy/k8s/base (tests/planner/test_autoscaler.py checks them).
TARGET_HPA = "specdec-target"
DRAFT_HPA = "specdec-draft"


@dataclass(frozen=True)
class Bounds:
    min_replicas: int
    max_replicas: int
    why: str  # a comment above the HPA in the patch


def patch(target: Bounds, draft: Bounds, header: str) -> str:
    """The patch's text: two YAML documents, `header` as comment lines on top."""
    lines = [f"# {line}".rstrip() for line in header.splitlines()]
    for name, bounds in ((TARGET_HPA, target), (DRAFT_HPA, draft)):
        if not 1 <= bounds.min_replicas <= bounds.max_replicas:
            raise ValueError(f"{name}: replica bounds {bounds} are not 1 <= min <= max")
        lines += [
            "---",
            *(f"# {line}".rstrip() for line in bounds.why.splitlines()),
            "apiVersion: autoscaling/v2",
            "kind: HorizontalPodAutoscaler",
            "metadata:",
            f"  name: {name}",
            "spec:",
            f"  minReplicas: {bounds.min_replicas}",
            f"  maxReplicas: {bounds.max_replicas}",
        ]
    return "\n".join(lines) + "\n"
