"""deploy/grafana: the dashboard is well formed, reads only contract metrics, covers what an
operator needs, and every query is valid PromQL (a real Prometheus parses each one)."""

from __future__ import annotations

import re
from collections.abc import Iterator

import pytest
from deploytools import (
    PanelQuery,
    PrometheusServer,
    contract_metrics,
    dashboard,
    grafana_to_promql,
    panel_queries,
    panels,
    prometheus,
    promql_metric_names,
)

from controller.state import State

DASH = dashboard()
QUERIES = panel_queries(DASH)
CONTRACT = contract_metrics()
HISTOGRAMS = {n for n, m in CONTRACT.items() if m.type == "histogram"}


def test_panels_are_well_formed() -> None:
    ids = [p["id"] for p in DASH["panels"]] + [
        p["id"] for row in DASH["panels"] if row["type"] == "row" for p in row.get("panels", [])
    ]
    assert len(ids) == len(set(ids)), "panel ids must be unique"
    for panel in panels(DASH):
        assert panel["title"]
        assert set(panel["gridPos"]) == {"h", "w", "x", "y"}
        assert panel["gridPos"]["x"] + panel["gridPos"]["w"] <= 24, panel["title"]
        assert panel["datasource"]["uid"] == "${datasource}", panel["title"]
        refs = [t["refId"] for t in panel["targets"]]
        assert refs, f"{panel['title']}: no query"
        assert len(refs) == len(set(refs)), panel["title"]


def test_panels_do_not_overlap() -> None:
    cells: dict[tuple[int, int], str] = {}
    for panel in DASH["panels"]:
        g = panel["gridPos"]
        for x in range(g["x"], g["x"] + g["w"]):
            for y in range(g["y"], g["y"] + g["h"]):
                assert (x, y) not in cells, f"{panel['title']} overlaps {cells[(x, y)]}"
                cells[(x, y)] = panel["title"]


def test_every_query_reads_contract_metrics_only() -> None:
    for q in QUERIES:
        names = promql_metric_names(q.expr, HISTOGRAMS)
        assert names, f"{q.panel}: reads no hotswap metric"
        assert names <= set(CONTRACT), (
            f"{q.panel}: not in docs/contracts.md: {names - set(CONTRACT)}"
        )
    variable = next(v for v in DASH["templating"]["list"] if v["name"] == "model")
    assert promql_metric_names(variable["definition"], HISTOGRAMS) <= set(CONTRACT)


def _reads(metric: str) -> list[str]:
    return [q.panel for q in QUERIES if metric in promql_metric_names(q.expr, HISTOGRAMS)]


@pytest.mark.parametrize(
    "metric",
    [
        "hotswap_model_state",
        "hotswap_phase_duration_seconds",
        "hotswap_transition_duration_seconds",
        "hotswap_bytes_released_total",
        "hotswap_verification_failures_total",
        "hotswap_gateway_queue_depth",
        "hotswap_gateway_hold_seconds",
        "hotswap_engine_restarts_total",
        "hotswap_swaps_total",
        "hotswap_model_device_info",
        "hotswap_model_host_bytes",
        "hotswap_demotions_total",
        "hotswap_host_backups_dropped_total",
        "hotswap_model_asleep_device_bytes",
        "hotswap_sleeps_total",
    ],
)
def test_the_required_views_exist(metric: str) -> None:
    assert _reads(metric), f"no panel reads {metric}"


def test_duration_percentiles_are_split_by_phase_and_kind() -> None:
    phase = [q for q in QUERIES if "hotswap_phase_duration_seconds_bucket" in q.expr]
    for kind in ("sleep", "wake"):
        found = [q for q in phase if f'kind="{kind}"' in q.expr]
        assert found, f"no {kind} phase panel"
        assert all(re.search(r"histogram_quantile\(", q.expr) for q in found)
        assert all(re.search(r"by \(phase, le\)", q.expr) for q in found)


def test_the_state_timeline_maps_every_state() -> None:
    """Each state gets its own code in the query, and the panel names each code's state."""
    (panel,) = [p for p in panels(DASH) if p["type"] == "state-timeline"]
    (target,) = panel["targets"]
    codes = {
        state: int(code)
        for state, code in re.findall(r'state="([A-Z]+)"\} \* (\d+)', target["expr"])
    }
    (mapping,) = panel["fieldConfig"]["defaults"]["mappings"]
    names = {int(code): m["text"] for code, m in mapping["options"].items()}
    assert set(names.values()) == {s.value for s in State}
    # A state without a term sums to 0, so exactly one state may be left out: code 0.
    assert set(codes) == {s.value for s in State} - {names[0]}
    assert all(names[code] == state for state, code in codes.items())


@pytest.fixture(scope="module")
def empty_prometheus(tmp_path_factory: pytest.TempPathFactory) -> Iterator[PrometheusServer]:
    with prometheus(tmp_path_factory.mktemp("prometheus"), targets=[]) as server:
        yield server


@pytest.mark.parametrize("query", QUERIES, ids=lambda q: f"{q.panel}/{q.ref_id}")
def test_every_query_is_valid_promql(empty_prometheus: PrometheusServer, query: PanelQuery) -> None:
    empty_prometheus.query(grafana_to_promql(query.expr, "1m"))  # raises on a parse error


def test_invalid_promql_is_reported(empty_prometheus: PrometheusServer) -> None:
    with pytest.raises(ValueError, match="bad_data"):
        empty_prometheus.query("sum by (model (hotswap_model_state)")
