"""deploy/prometheus: promtool checks the rules and runs their unit tests; every alert has a
unit test where it fires and one where it does not; the rules read only contract metrics."""

from __future__ import annotations

from typing import Any

import pytest
import yaml
from deploytools import (
    RULES,
    RULES_TEST,
    contract_metrics,
    promql_metric_names,
    run,
    tool,
)


def _rules() -> list[dict[str, Any]]:
    doc = yaml.safe_load(RULES.read_text())
    return [rule for group in doc["groups"] for rule in group["rules"]]


ALERTS = [r["alert"] for r in _rules() if "alert" in r]


def test_promtool_check_rules() -> None:
    out = run([tool("promtool"), "check", "rules", str(RULES)])
    assert f"SUCCESS: {len(_rules())} rules found" in out


def test_promtool_test_rules() -> None:
    out = run([tool("promtool"), "test", "rules", RULES_TEST.name], cwd=RULES_TEST.parent)
    assert "SUCCESS" in out


def test_the_required_alerts_exist() -> None:
    assert set(ALERTS) >= {
        "HotswapModelFailed",
        "HotswapVerificationFailure",
        "HotswapWakeSlow",
        "HotswapSwapThrash",
    }


@pytest.mark.parametrize("alert", ALERTS)
def test_each_alert_is_tested_firing_and_not_firing(alert: str) -> None:
    tests = yaml.safe_load(RULES_TEST.read_text())["tests"]
    cases = [
        case
        for test in tests
        for case in test.get("alert_rule_test", [])
        if case["alertname"] == alert
    ]
    assert any(case.get("exp_alerts") for case in cases), f"{alert}: no test where it fires"
    assert any(not case.get("exp_alerts") for case in cases), f"{alert}: no test where it is quiet"


def test_promtool_test_rules_can_fail(tmp_path: Any) -> None:
    """A rule that no longer fires when its test says it should makes promtool fail."""
    doc = yaml.safe_load(RULES.read_text())
    for group in doc["groups"]:
        for rule in group["rules"]:
            if rule.get("alert") == "HotswapModelFailed":
                rule["for"] = "1h"
    (tmp_path / RULES.name).write_text(yaml.safe_dump(doc))
    (tmp_path / RULES_TEST.name).write_text(RULES_TEST.read_text())
    with pytest.raises(pytest.fail.Exception, match="HotswapModelFailed"):
        run([tool("promtool"), "test", "rules", RULES_TEST.name], cwd=tmp_path)


def test_rules_read_only_contract_metrics() -> None:
    contract = contract_metrics()
    histograms = {n for n, m in contract.items() if m.type == "histogram"}
    for rule in _rules():
        names = promql_metric_names(rule["expr"], histograms)
        assert names, f"{rule.get('alert')}: reads no hotswap metric"
        assert names <= set(contract), f"{rule.get('alert')}: {sorted(names - set(contract))}"
