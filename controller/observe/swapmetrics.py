"""Hot-swap metrics (contracts.md section 5): swaps, evictions, the gateway's queues and
refusals, engine restarts. Counters and histograms updated where the events happen; the
registry is injected, like `controller.observe.metrics.Metrics`."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import GaugeMetricFamily, Metric

from controller.observe.metrics import SECONDS_BUCKETS

# Why the sidecar put a model to sleep (hotswap_sleeps_total's `reason`).
SLEEP_REASONS = ("request", "evict", "boot", "idle", "host_budget")


@dataclass(frozen=True)
class FleetRow:
    """What the fleet collector reads of one model at scrape time."""

    model: str
    devices: tuple[str, ...]
    host_bytes: int
    asleep_bytes: int


class _FleetCollector:
    """Placement and host memory, read from the records on every scrape."""

    def __init__(self, rows: Callable[[], Iterable[FleetRow]]) -> None:
        self._rows = rows

    @staticmethod
    def _families() -> tuple[GaugeMetricFamily, GaugeMetricFamily, GaugeMetricFamily]:
        return (
            GaugeMetricFamily(
                "hotswap_model_device_info",
                "1 for every device a model's engine is placed on.",
                labels=["model", "device"],
            ),
            GaugeMetricFamily(
                "hotswap_model_host_bytes",
                "Host RAM the model holds now (a level-1 sleeper's weights, a kept backup).",
                labels=["model"],
            ),
            GaugeMetricFamily(
                "hotswap_model_asleep_device_bytes",
                "Device memory an engine holds besides its pools (worker-reported at its last "
                "suspend), as the device policy counts it awake and asleep.",
                labels=["model"],
            ),
        )

    def describe(self) -> Iterator[Metric]:
        yield from self._families()

    def collect(self) -> Iterator[Metric]:
        placed, host, asleep = self._families()
        for row in self._rows():
            for d in row.devices:
                placed.add_metric([row.model, d], 1.0)
            host.add_metric([row.model], float(row.host_bytes))
            asleep.add_metric([row.model], float(row.asleep_bytes))
        yield from (placed, host, asleep)


REFUSAL_REASONS = (
    "queue_full",
    "wake_failed",
    "wake_timeout",
    "engine_unavailable",  # the engine did not answer a forwarded request (it died)
    "unknown_model",
    "unauthorized",
    "too_many_requests",  # the gateway's cap on requests at once (gateway.max_concurrent)
    "too_large",  # a body over gateway.max_body_bytes
    "client_gone",  # a held request whose client disconnected
    "starting",  # the start-up reconciliation is in progress
    "shutting_down",  # a SIGTERM's drain: nothing new is admitted
)


class SwapMetrics:
    def __init__(self, registry: CollectorRegistry) -> None:
        self.registry = registry
        self._swaps = Counter(
            "hotswap_swaps_total",
            "Wakes run by the swap policy, by the woken model and result.",
            ["model", "result"],
            registry=registry,
        )
        self._swap_seconds = Histogram(
            "hotswap_swap_duration_seconds",
            "Sleep of the evicted models plus the wake of the requested one.",
            ["model"],
            buckets=SECONDS_BUCKETS,
            registry=registry,
        )
        self._evictions = Counter(
            "hotswap_evictions_total",
            "Models put to sleep to make room for another, by the evicted model.",
            ["model", "reason"],
            registry=registry,
        )
        self._queue_depth = Gauge(
            "hotswap_gateway_queue_depth",
            "Requests the gateway holds for a model that is not RUNNING.",
            ["model"],
            registry=registry,
        )
        self._hold_seconds = Histogram(
            "hotswap_gateway_hold_seconds",
            "Time a request waited for its model to be RUNNING.",
            ["model"],
            buckets=SECONDS_BUCKETS,
            registry=registry,
        )
        self._requests = Counter(
            "hotswap_gateway_requests_total",
            "Gateway requests by model and HTTP status answered.",
            ["model", "code"],
            registry=registry,
        )
        self._refused = Counter(
            "hotswap_gateway_refused_total",
            "Gateway requests refused before reaching an engine.",
            ["model", "reason"],
            registry=registry,
        )
        self._sleeps = Counter(
            "hotswap_sleeps_total",
            "Sleeps through the swap coordinator, by model and reason "
            "(request, evict, boot, idle, host_budget).",
            ["model", "reason"],
            registry=registry,
        )
        self._demotions = Counter(
            "hotswap_demotions_total",
            "Level-1 sleepers demoted to level 2 (host copy released), by model and reason.",
            ["model", "reason"],
            registry=registry,
        )
        self._backups_dropped = Counter(
            "hotswap_host_backups_dropped_total",
            "Awake models whose kept host backup was released for the host budget.",
            ["model"],
            registry=registry,
        )
        self._restarts = Counter(
            "hotswap_engine_restarts_total",
            "Managed engines restarted after a crash or a FAILED transition.",
            ["model"],
            registry=registry,
        )

    def register_model(self, model: str) -> None:
        """Create the model's plain counters at zero, so its first swap, eviction or restart
        shows in increase()/rate() (and a model never restarted reads 0, not no data)."""
        self._restarts.labels(model)
        self._queue_depth.labels(model).set(0)
        self._sleeps.labels(model, "idle")
        self._demotions.labels(model, "host_budget")
        self._backups_dropped.labels(model)

    def read_fleet(self, rows: Callable[[], Iterable[FleetRow]]) -> None:
        """Register the placement and host-memory gauges, read from `rows()` at scrape."""
        self.registry.register(_FleetCollector(rows))

    def slept(self, model: str, reason: str) -> None:
        if reason not in SLEEP_REASONS:
            raise ValueError(f"unknown sleep reason {reason!r}")
        self._sleeps.labels(model, reason).inc()

    def demotion(self, model: str, reason: str = "host_budget") -> None:
        self._demotions.labels(model, reason).inc()

    def backup_dropped(self, model: str) -> None:
        self._backups_dropped.labels(model).inc()

    def swap(self, model: str, result: str, seconds: float | None = None) -> None:
        self._swaps.labels(model, result).inc()
        if seconds is not None:
            self._swap_seconds.labels(model).observe(seconds)

    def eviction(self, model: str, reason: str) -> None:
        self._evictions.labels(model, reason).inc()

    def queue_depth(self, model: str, depth: int) -> None:
        self._queue_depth.labels(model).set(depth)

    def hold(self, model: str, seconds: float) -> None:
        self._hold_seconds.labels(model).observe(seconds)

    def request(self, model: str, code: int) -> None:
        self._requests.labels(model, str(code)).inc()

    def refused(self, model: str, reason: str) -> None:
        if reason not in REFUSAL_REASONS:
            raise ValueError(f"unknown refusal reason {reason!r}")
        self._refused.labels(model, reason).inc()

    def restart(self, model: str) -> None:
        self._restarts.labels(model).inc()
