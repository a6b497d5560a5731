"""The dashboard against real data: a real Prometheus scrapes a real `hotswap serve` (gateway
on, one model awake at a time) while it sleeps, wakes and swaps two CPU vLLM servers, through
its API and through gateway requests; then every panel's query, run through Prometheus' HTTP
API, returns data, and no panel names a metric the sidecar does not export.

The two servers are the lane's demo pair (tests/conftest.py `demo_pair`: this module runs in
the integration lane, beside the modules that share it), left awake at the end.

Panels whose metrics a setup cannot produce would be listed in EXPECTED_EMPTY (none now),
checked against docs/contracts.md section 5 by name; a listed panel that returns data fails
here, as a reminder to shrink the list.
"""

from __future__ import annotations

import contextlib
import math
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import httpx
import pytest
import yaml
from deploytools import (
    RULES,
    PanelQuery,
    PrometheusServer,
    contract_metrics,
    dashboard,
    exported_metric_names,
    grafana_to_promql,
    panel_queries,
    panels,
    prometheus,
    promql_metric_names,
)
from support.sidecar import SidecarProcess
from support.sidecarthread import SidecarThread, attached, leave_awake

if TYPE_CHECKING:
    from support.sidecarthread import DemoPair

pytestmark = pytest.mark.vllm

# Panels with no data in this setup. Empty now: the restarts counter exists at zero for every
# model, so "Engine restarts" reads 0 here. Never add a panel of a section 4 metric here.
EXPECTED_EMPTY: frozenset[str] = frozenset()

DASH = dashboard()
QUERIES = panel_queries(DASH)
CONTRACT = contract_metrics()
HISTOGRAMS = {n for n, m in CONTRACT.items() if m.type == "histogram"}
MODELS = ("tiny-a", "tiny-b")  # the demo pair's
JOB = "hotswap"


@dataclass(frozen=True)
class Observed:
    prom: PrometheusServer
    started: float  # unix seconds, before the first cycle
    ended: float  # unix seconds, after the last scrape of the last cycle
    exposition: str  # the sidecar's /metrics at the end

    def window(self) -> str:
        """A range covering the whole run, for the panels' $__rate_interval."""
        return f"{math.ceil(time.time() - self.started) + 5}s"


def start_sidecar(engines: dict[str, str], log_path: Path) -> SidecarProcess:
    """`hotswap serve` attached to the given engines, as a pod runs it, with the gateway on
    and a budget of one awake model (so wakes evict and requests swap); returned once every
    engine is probed (awake or asleep, as the budget left it)."""
    side = SidecarProcess(log_path, engines=engines, env={"HOTSWAP_SWAP__MAX_AWAKE": "1"})
    side.start()
    deadline = time.monotonic() + 120
    while True:
        with contextlib.suppress(httpx.HTTPError):
            states = {n: m["state"] for n, m in side.models().items()}
            if set(states) == set(MODELS) and set(states.values()) <= {"RUNNING", "SUSPENDED"}:
                return side
        if time.monotonic() > deadline:
            side.stop()
            pytest.fail(f"hotswap serve did not settle in 120 s:\n{side.log_tail()}")
        time.sleep(0.2)


def _call(side: SidecarProcess, path: str, **body: Any) -> dict[str, Any]:
    resp = side.post(path, json=body, params={"wait": "true"})
    assert resp.status_code == 200, f"{path}: {resp.status_code} {resp.text}"
    data: dict[str, Any] = resp.json()
    return data


def _complete(side: SidecarProcess, model: str) -> httpx.Response:
    """One short completion through the gateway."""
    body = {"model": model, "prompt": "Hello", "max_tokens": 2, "temperature": 0}
    return httpx.post(f"{side.gateway_url}/v1/completions", json=body, timeout=300)


@pytest.fixture(scope="module")
def observed(demo_pair: DemoPair, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Observed]:
    urls = {name: f"unix:{demo_pair.models[name].uds}" for name in MODELS}
    work = tmp_path_factory.mktemp("observe")
    sidecar = start_sidecar(urls, work / "sidecar.log")
    try:
        target = sidecar.url.removeprefix("http://")
        with prometheus(work, targets=[target]) as prom:
            prom.wait_scrapes(JOB, 2, timeout_s=30)
            started = time.time()
            # Each step's state is held for a few scrapes, so the timeline sees it.
            steps: list[tuple[str, str, int | None]] = [
                ("sleep", "tiny-a", 1),
                ("wake", "tiny-a", None),  # one awake at most: tiny-b is evicted
                ("sleep", "tiny-a", 2),
                ("wake", "tiny-a", None),
                ("request", "tiny-b", None),  # held at the gateway: tiny-b wakes, tiny-a evicted
                ("request", "tiny-b", None),  # tiny-b awake: straight through
                ("request", "tiny-a", None),  # held, tiny-b evicted
                # Held again: a histogram's first observation creates its series, which rate()
                # cannot see; the second one makes the hold percentiles real numbers.
                ("request", "tiny-b", None),
                ("request", "no-such-model", None),  # refused
            ]
            for action, name, level in steps:
                if action == "sleep":
                    assert (
                        _call(sidecar, f"/models/{name}/sleep", level=level)["state"] == "SUSPENDED"
                    )
                elif action == "wake":
                    assert _call(sidecar, f"/models/{name}/wake")["state"] == "RUNNING"
                else:
                    resp = _complete(sidecar, name)
                    expected = 200 if name in MODELS else 404
                    assert resp.status_code == expected, resp.text
                prom.wait_scrapes(JOB, 3, timeout_s=30)
            states = {n: m["state"] for n, m in sidecar.models().items()}
            assert states == {"tiny-a": "SUSPENDED", "tiny-b": "RUNNING"}
            exposition = sidecar.get("/metrics", timeout=10).text
            yield Observed(prom, started, time.time(), exposition)
    finally:
        sidecar.stop()
    # The pair as the lane's next module expects it: both awake (one is asleep here).
    side = SidecarThread(attached(list(demo_pair.models.values()))).start()
    try:
        leave_awake(side)
    finally:
        side.stop()


def _values(rows: list[dict[str, Any]]) -> list[float]:
    return [float(r["value"][1]) for r in rows]


@pytest.mark.parametrize("query", QUERIES, ids=lambda q: f"{q.panel}/{q.ref_id}")
def test_every_panel_query_returns_data(observed: Observed, query: PanelQuery) -> None:
    rows = observed.prom.query(grafana_to_promql(query.expr, observed.window()))
    if query.panel in EXPECTED_EMPTY:
        assert rows == [], f"{query.panel!r} returns data now: remove it from EXPECTED_EMPTY"
        return
    assert rows, f"{query.panel!r} ({query.ref_id}) returned no data:\n{query.expr}"
    if "histogram_quantile" in query.expr:
        assert any(math.isfinite(v) for v in _values(rows)), f"{query.panel!r}: only NaN"


def test_the_state_timeline_follows_the_cycles(observed: Observed) -> None:
    (panel,) = [p for p in panels(DASH) if p["type"] == "state-timeline"]
    (mapping,) = panel["fieldConfig"]["defaults"]["mappings"]
    code = {m["text"]: float(c) for c, m in mapping["options"].items()}
    rows = observed.prom.query_range(
        grafana_to_promql(panel["targets"][0]["expr"], "1m"),
        observed.started,
        observed.ended,
        step_s=1,
    )
    seen = {r["metric"]["model"]: {float(v) for _, v in r["values"]} for r in rows}
    assert set(seen) == set(MODELS)
    for model in MODELS:
        assert {code["RUNNING"], code["SUSPENDED"]} <= seen[model], (model, seen[model])
        assert code["FAILED"] not in seen[model]


def test_sleeps_released_bytes(observed: Observed) -> None:
    """Every sleep released bytes; the panel's rate shows them from a model's second sleep on.

    A labelled counter's first increment creates its series at the incremented value, and
    rate() has no earlier sample to subtract: tiny-b slept once, so only the raw counter shows
    it, while tiny-a slept twice. (Counters created at zero when the pools are known would make
    the first sleep visible too.)"""
    (query,) = [q for q in QUERIES if q.panel.startswith("Bytes released")]
    rows = observed.prom.query(grafana_to_promql(query.expr, observed.window()))
    assert {r["metric"]["model"] for r in rows if float(r["value"][1]) > 0} >= {"tiny-a"}
    totals = observed.prom.query("sum by (model) (hotswap_bytes_released_total)")
    assert {r["metric"]["model"] for r in totals if float(r["value"][1]) > 0} == set(MODELS)


def test_no_panel_names_a_metric_the_sidecar_does_not_export(observed: Observed) -> None:
    exported = exported_metric_names(observed.exposition)
    section5 = {n for n, m in CONTRACT.items() if m.section == 5}
    for query in QUERIES:
        names = promql_metric_names(query.expr, HISTOGRAMS)
        assert names <= exported, f"{query.panel!r}: not exported: {sorted(names - exported)}"
        if query.panel in EXPECTED_EMPTY:
            assert names <= section5, f"{query.panel!r}: {sorted(names - section5)}"


def test_the_alerts_are_quiet_on_a_healthy_sidecar(observed: Observed) -> None:
    """The alert expressions evaluate on real series and find nothing wrong."""
    rules = [r for g in yaml.safe_load(RULES.read_text())["groups"] for r in g["rules"]]
    for rule in rules:
        assert observed.prom.query(rule["expr"]) == [], rule["alert"]
    # ...and HotswapModelFailed is quiet because no model is FAILED, not for lack of input.
    failed = observed.prom.query('hotswap_model_state{state="FAILED"}')
    assert {r["metric"]["model"] for r in failed} == set(MODELS)
    assert _values(failed) == [0.0] * len(MODELS)
