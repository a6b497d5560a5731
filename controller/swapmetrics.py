"""Hot-swap metrics (contracts.md section 5): swaps, evictions, the gateway's queues and
refusals, engine restarts. Counters and histograms updated where the events happen; the
registry is injected, like `controller.metrics.Metrics`."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from controller.metrics import SECONDS_BUCKETS

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
