"""The alert rules and the dashboard in deploy/: the rules pass `promtool check rules` (Debian's `prometheus`), the
dashboard is Grafana JSON whose every panel has a query; every metric either names is one the router exports
(checked against a served bundle's /metrics in tests/test_serve.py, ``metric_names_in_deploy`` below)."""

import json
import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[1]
RULES = ROOT / "deploy" / "prometheus" / "policy-bundle-rules.yaml"
DASHBOARD = ROOT / "deploy" / "grafana" / "policy-bundle-dashboard.json"
SUFFIXES = ("_bucket", "_count", "_sum")


def queries() -> list:
    rules = [r["expr"] for g in yaml.safe_load(RULES.read_text())["groups"] for r in g["rules"]]
    panels = [t["expr"] for p in json.loads(DASHBOARD.read_text())["panels"] for t in p["targets"]]
    return rules + panels


def metric_names_in_deploy() -> set:
    """Every ``policy_*`` series the rules and the dashboard query, as the metric it belongs to (a histogram's
    ``_bucket``, ``_count`` and ``_sum`` are its own name)."""
    names = set()
    for expr in queries():
        for name in re.findall(r"\bpolicy_[a-z0-9_]+", expr):
            for suffix in SUFFIXES:
                if name.endswith(suffix) and not name.endswith("_total"):
                    name = name[: -len(suffix)]
            names.add(name)
    return names


def test_the_alert_rules_pass_promtool():
    promtool = shutil.which("promtool")
    if promtool is None:  # under CI (.ci/run installs it) a failure, as conftest.missing makes it
        if os.environ.get("POLICY_BUNDLE_CI"):
            pytest.fail("promtool (Debian's prometheus package) is not installed (CI requires it)")
        pytest.skip("promtool (Debian's prometheus package) is not installed")
    res = subprocess.run([promtool, "check", "rules", str(RULES)], capture_output=True, text=True, timeout=60)
    assert res.returncode == 0 and "SUCCESS" in res.stdout, res.stdout + res.stderr
    broken = RULES.with_name("broken.yaml")  # the negative control: promtool does reject a bad expression
    try:
        broken.write_text(RULES.read_text().replace("max(policy_fp16_fallback) == 1", "max(policy_fp16_fallback ==", 1))
        bad = subprocess.run([promtool, "check", "rules", str(broken)], capture_output=True, text=True, timeout=60)
    finally:
        broken.unlink()
    assert bad.returncode != 0


def test_the_dashboard_is_grafana_json_with_a_query_per_panel_and_the_alerts_cover_what_operators_page_on():
    dash = json.loads(DASHBOARD.read_text())
    assert dash["uid"] and dash["panels"] and all(p["targets"] and all(t["expr"] for t in p["targets"])
                                                  for p in dash["panels"])
    ids = [p["id"] for p in dash["panels"]]
    assert len(ids) == len(set(ids))
    alerts = {r["alert"] for g in yaml.safe_load(RULES.read_text())["groups"] for r in g["rules"]}
    assert {"PolicyInt8RolledBack", "PolicyVariantDown", "PolicyLatencyP99High", "PolicyErrorBudgetBurn"} <= alerts
    names = metric_names_in_deploy()
    for wanted in ("policy_time_to_first_token_seconds", "policy_inter_token_latency_seconds",
                   "policy_engine_queue_wait_seconds", "policy_engine_batch_size", "policy_kv_cache_bytes"):
        assert wanted in names


@pytest.mark.parametrize("name", ["policy_int8_weight_percent", "policy_shadow_agreement", "policy_variant_engine"])
def test_off_convention_names_are_gone(name):
    text = (ROOT / "serve" / "router" / "metrics.py").read_text()
    assert f'name="{name}"' not in text
