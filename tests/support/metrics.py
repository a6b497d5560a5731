"""Reading Prometheus text in tests: one sum over the samples that match."""

from __future__ import annotations

from prometheus_client.parser import text_string_to_metric_families


def metric_sum(text: str, *names: str, **labels: str) -> float:
    """The sum of the samples named any of `names` whose labels include `labels`."""
    return sum(
        s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
        if s.name in names and all(s.labels.get(k) == v for k, v in labels.items())
    )
