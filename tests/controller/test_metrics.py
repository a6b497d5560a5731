"""Metrics: the collector reads snapshots at scrape time; event methods move the series."""

from __future__ import annotations

import pytest
from prometheus_client import CollectorRegistry, generate_latest

from controller.observe.metrics import Metrics
from controller.observe.swapmetrics import SwapMetrics
from controller.state import ModelSnapshot, State


def test_state_gauges_follow_the_snapshots_at_scrape_time() -> None:
    snaps = {"a": ModelSnapshot("a", State.RUNNING, 100.0, verified=True)}
    registry = CollectorRegistry()
    Metrics(registry, lambda: snaps)

    def value(name: str, **labels: str) -> float | None:
        return registry.get_sample_value(name, labels)

    assert value("hotswap_model_state", model="a", state="RUNNING") == 1.0
    assert value("hotswap_model_state", model="a", state="SUSPENDED") == 0.0
    assert value("hotswap_model_ready", model="a") == 1.0
    assert value("hotswap_model_state_since_seconds", model="a") == 100.0
    # No copy is kept: the next scrape sees the new snapshot.
    snaps["a"] = ModelSnapshot("a", State.SUSPENDED, 200.0, level=1)
    snaps["b"] = ModelSnapshot("b", State.FAILED, 50.0)
    assert value("hotswap_model_state", model="a", state="SUSPENDED") == 1.0
    assert value("hotswap_model_ready", model="a") == 0.0
    assert value("hotswap_model_state_since_seconds", model="a") == 200.0
    assert value("hotswap_model_state", model="b", state="FAILED") == 1.0
    text = generate_latest(registry).decode()
    assert text.count('hotswap_model_state{model="b"') == len(State)


def test_event_methods_update_counters_and_histograms() -> None:
    registry = CollectorRegistry()
    m = Metrics(registry, list)
    m.transition("a", "sleep", "RUNNING", "SUSPENDED", "ok", 1.5)
    m.transition("a", "sleep", "RUNNING", "SUSPENDED", "ok")
    m.phase("a", "sleep", "suspend", 0.75)
    m.bytes("a", "released", "weights", 100)
    m.bytes("a", "released", "weights", 23)
    m.bytes("a", "restored", "kv_cache", 7)
    m.verification_failure("a")
    m.rpc_error("a", "hotswap_suspend", "timeout")
    get = registry.get_sample_value
    t = {"model": "a", "kind": "sleep", "from_state": "RUNNING", "to_state": "SUSPENDED"}
    assert get("hotswap_transitions_total", {**t, "result": "ok"}) == 2
    assert get("hotswap_transition_duration_seconds_count", {"model": "a", "kind": "sleep"}) == 1
    assert get("hotswap_transition_duration_seconds_sum", {"model": "a", "kind": "sleep"}) == 1.5
    ph = {"model": "a", "kind": "sleep", "phase": "suspend"}
    assert get("hotswap_phase_duration_seconds_bucket", {**ph, "le": "0.5"}) == 0
    assert get("hotswap_phase_duration_seconds_bucket", {**ph, "le": "1.0"}) == 1
    assert get("hotswap_bytes_released_total", {"model": "a", "pool": "weights"}) == 123
    assert get("hotswap_bytes_restored_total", {"model": "a", "pool": "kv_cache"}) == 7
    assert get("hotswap_verification_failures_total", {"model": "a"}) == 1
    rpc = {"model": "a", "method": "hotswap_suspend", "reason": "timeout"}
    assert get("hotswap_engine_rpc_errors_total", rpc) == 1
    with pytest.raises(ValueError, match="direction"):
        m.bytes("a", "sideways", "weights", 1)


def test_two_metrics_on_one_registry_collide() -> None:
    registry = CollectorRegistry()
    Metrics(registry, list)
    with pytest.raises(ValueError, match="Duplicated"):
        Metrics(registry, list)


def test_registered_model_counters_start_at_zero() -> None:
    """The first event of a model must be visible to rate(): its series exist beforehand."""
    registry = CollectorRegistry()
    metrics = Metrics(registry, list)
    metrics.register_model("m")
    assert registry.get_sample_value("hotswap_verification_failures_total", {"model": "m"}) == 0
    for pool in ("weights", "kv_cache"):
        labels = {"model": "m", "pool": pool}
        assert registry.get_sample_value("hotswap_bytes_released_total", labels) == 0
        assert registry.get_sample_value("hotswap_bytes_restored_total", labels) == 0


def test_swap_metrics_register_restarts_at_zero() -> None:
    registry = CollectorRegistry()
    swap = SwapMetrics(registry)
    assert registry.get_sample_value("hotswap_engine_restarts_total", {"model": "m"}) is None
    swap.register_model("m")
    assert registry.get_sample_value("hotswap_engine_restarts_total", {"model": "m"}) == 0
    assert registry.get_sample_value("hotswap_gateway_queue_depth", {"model": "m"}) == 0
    swap.restart("m")
    assert registry.get_sample_value("hotswap_engine_restarts_total", {"model": "m"}) == 1
