"""Prometheus metrics: state gauges read from the manager's snapshots at scrape time, and
counters/histograms updated by the manager where events happen. The registry is injected."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Mapping

from prometheus_client import CollectorRegistry, Counter, Histogram, disable_created_metrics
from prometheus_client.core import GaugeMetricFamily, Metric

from controller.state import ModelSnapshot, State

# Seconds: a drain or a level-1 suspend of a large model takes minutes, a quiesce milliseconds.
SECONDS_BUCKETS = (
    0.005,
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    0.5,
    1.0,
    2.5,
    5.0,
    10.0,
    30.0,
    60.0,
    120.0,
    300.0,
    600.0,
)

Snapshots = Iterable[ModelSnapshot] | Mapping[str, ModelSnapshot]


class _StateCollector:
    """Reads the snapshots on every scrape; holds no copy of the state."""

    def __init__(self, snapshots: Callable[[], Snapshots]) -> None:
        self._snapshots = snapshots

    def _families(self) -> tuple[GaugeMetricFamily, ...]:
        return (
            GaugeMetricFamily(
                "hotswap_model_state",
                "1 for the state the model is in, 0 for the others.",
                labels=["model", "state"],
            ),
            GaugeMetricFamily(
                "hotswap_model_ready",
                "1 when the model is RUNNING and verified since its last memory transition.",
                labels=["model"],
            ),
            GaugeMetricFamily(
                "hotswap_model_state_since_seconds",
                "Unix time of the model's last state change.",
                labels=["model"],
            ),
            GaugeMetricFamily(
                "hotswap_model_deep",
                "1 while the model's engine is checkpointed by the driver (a deep sleep).",
                labels=["model"],
            ),
            GaugeMetricFamily(
                "hotswap_model_resident_bytes",
                "Asleep: device bytes its engine holds (NVML-measured when deep).",
                labels=["model"],
            ),
        )

    def describe(self) -> Iterator[Metric]:
        yield from self._families()

    def collect(self) -> Iterator[Metric]:
        state, ready, since, deep, resident = self._families()
        items = self._snapshots()
        snaps = items.values() if isinstance(items, Mapping) else items
        for snap in snaps:
            for s in State:
                state.add_metric([snap.name, s.value], 1.0 if snap.state is s else 0.0)
            ready.add_metric([snap.name], 1.0 if snap.ready else 0.0)
            since.add_metric([snap.name], snap.since)
            deep.add_metric([snap.name], 1.0 if snap.deep else 0.0)
            if snap.resident_bytes is not None:
                resident.add_metric([snap.name], float(snap.resident_bytes))
        yield from (state, ready, since, deep, resident)


class Metrics:
    """The sidecar's own metrics (contracts.md section 4)."""

    def __init__(
        self, registry: CollectorRegistry, snapshots: Callable[[], Snapshots] | None = None
    ) -> None:
        """`snapshots` is what the state collector reads at scrape time; when None, the
        Manager given these metrics binds its own (`read_from`)."""
        # No `_created` twin of every counter and histogram (a third of the samples, and
        # nothing a dashboard reads); process-wide in prometheus_client, which this process is.
        disable_created_metrics()  # type: ignore[no-untyped-call]
        self.registry = registry
        self._collector: _StateCollector | None = None
        self._transitions = Counter(
            "hotswap_transitions_total",
            "Finished sleep/wake/start transitions.",
            ["model", "kind", "from_state", "to_state", "result"],
            registry=registry,
        )
        self._transition_seconds = Histogram(
            "hotswap_transition_duration_seconds",
            "Duration of a whole transition.",
            ["model", "kind"],
            buckets=SECONDS_BUCKETS,
            registry=registry,
        )
        self._phase_seconds = Histogram(
            "hotswap_phase_duration_seconds",
            "Duration of one phase of a transition.",
            ["model", "kind", "phase"],
            buckets=SECONDS_BUCKETS,
            registry=registry,
        )
        self._released = Counter(
            "hotswap_bytes_released_total",
            "Bytes released by sleeps, summed over ranks.",
            ["model", "pool"],
            registry=registry,
        )
        self._restored = Counter(
            "hotswap_bytes_restored_total",
            "Bytes mapped back by wakes, summed over ranks.",
            ["model", "pool"],
            registry=registry,
        )
        self._verification_failures = Counter(
            "hotswap_verification_failures_total",
            "Wakes whose bit-exact verification found a mismatch.",
            ["model"],
            registry=registry,
        )
        self._unverified_wakes = Counter(
            "hotswap_unverified_wakes_total",
            "Wakes served with nothing verified: vLLM's own wake of a plain engine, accepted "
            "by the model's accept_unverified_wake (docs/contracts.md §2.3).",
            ["model"],
            registry=registry,
        )
        self._rpc_errors = Counter(
            "hotswap_engine_rpc_errors_total",
            "Failed calls to an engine (RPC or control endpoint).",
            ["model", "method", "reason"],
            registry=registry,
        )
        self._deep_sleeps = Counter(
            "hotswap_deep_sleeps_total",
            "Deep sleeps asked for, by result: ok, failed (asleep, not deep), refused.",
            ["model", "result"],
            registry=registry,
        )
        self._checkpoint_seconds = Histogram(
            "hotswap_checkpoint_seconds",
            "The driver's own time of a checkpoint or restore of an engine's processes.",
            ["model", "op"],
            buckets=SECONDS_BUCKETS,
            registry=registry,
        )
        if snapshots is not None:
            self.read_from(snapshots)

    @property
    def bound(self) -> bool:
        return self._collector is not None

    def read_from(self, snapshots: Callable[[], Snapshots]) -> None:
        """Register the state collector over `snapshots`; once per Metrics."""
        if self._collector is not None:
            raise RuntimeError("these metrics already read the state of a manager")
        self._collector = _StateCollector(snapshots)
        self.registry.register(self._collector)

    def register_model(self, model: str, pools: Iterable[str] = ("weights", "kv_cache")) -> None:
        """Create the model's counters at zero, so the first event shows in rate()/increase()
        (a series that appears at its first value has no earlier sample to differ from)."""
        self._verification_failures.labels(model)
        self._unverified_wakes.labels(model)
        for pool in pools:
            self._released.labels(model, pool)
            self._restored.labels(model, pool)

    def transition(
        self,
        model: str,
        kind: str,
        from_state: str,
        to_state: str,
        result: str,
        duration_s: float | None = None,
    ) -> None:
        self._transitions.labels(model, kind, str(from_state), str(to_state), result).inc()
        if duration_s is not None:
            self._transition_seconds.labels(model, kind).observe(duration_s)

    def phase(self, model: str, kind: str, phase: str, seconds: float) -> None:
        self._phase_seconds.labels(model, kind, phase).observe(seconds)

    def bytes(self, model: str, direction: str, pool: str, n: int) -> None:
        if direction == "released":
            self._released.labels(model, pool).inc(n)
        elif direction == "restored":
            self._restored.labels(model, pool).inc(n)
        else:
            raise ValueError(f"direction must be 'released' or 'restored', not {direction!r}")

    def verification_failure(self, model: str) -> None:
        self._verification_failures.labels(model).inc()

    def unverified_wake(self, model: str) -> None:
        self._unverified_wakes.labels(model).inc()

    def rpc_error(self, model: str, method: str, reason: str) -> None:
        self._rpc_errors.labels(model, method, reason).inc()

    def deep_sleep(self, model: str, result: str) -> None:
        self._deep_sleeps.labels(model, result).inc()

    def checkpoint(self, model: str, op: str, seconds: float) -> None:
        self._checkpoint_seconds.labels(model, op).observe(seconds)
