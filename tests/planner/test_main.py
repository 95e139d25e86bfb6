"""python -m planner: the plan beside its inputs, the fleet table, the autoscaler patch."""

from __future__ import annotations

import pytest
import yaml

from planner.__main__ import main


def test_the_planner_prints_its_plan_and_writes_the_patch(make_costs, tmp_path, capsys):
    costs = make_costs(acceptance=(0.9,) * 4, draft={"ms_by_batch": ((1, 0.5),)})
    costs.save(tmp_path / "costs.json")
    patch = tmp_path / "hpa.yaml"
    quick = ["--requests", "30", "--steps", "1", "--ks", "2", "--ratios", "1:2,1:1"]
    argv = [str(tmp_path / "costs.json"), "--objective", "tpot-p90-ms=40", "--targets", "10"]
    assert main([*argv, *quick, "--fleet", "1,10,1000", "--kustomize-patch", str(patch)]) == 0
    out = capsys.readouterr().out
    for heading in ("## Inputs", "## Configurations", "## Plan", "## Fleet"):
        assert heading in out
    for said in (
        "- layout:",
        "- speculation:",
        "- goodput:",
        "- remote draft pool:",
        "source: test",
    ):
        assert said in out
    table = [line for line in out.split("## Fleet")[1].splitlines() if line.startswith("|")]
    assert [row.split("|")[1].strip() for row in table[2:]] == ["1", "10", "1000"]
    docs = [doc for doc in yaml.safe_load_all(patch.read_text()) if doc]
    assert docs[0]["spec"]["maxReplicas"] == 10
    assert docs[0]["spec"]["minReplicas"] <= 10 and docs[1]["spec"]["minReplicas"] >= 1


def test_a_wrong_objective_is_a_usage_error(make_costs, tmp_path):
    make_costs().save(tmp_path / "costs.json")
    with pytest.raises(SystemExit):
        main([str(tmp_path / "costs.json"), "--objective", "fast"])
