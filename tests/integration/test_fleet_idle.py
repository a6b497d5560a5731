"""Idle sleep on a real CPU vLLM server in attached mode (the managed case is in
test_fleet_placement): the sidecar puts the engine to sleep once it served nothing for
`idle_sleep_s`, never while a request streams, counts it with reason `idle`, and the
gateway's next request wakes it and is answered."""

from __future__ import annotations

import time
from collections.abc import Iterator

import httpx
import pytest
from support.sidecarthread import Api, DemoPair, SidecarThread, attached, sidecar_over

pytestmark = pytest.mark.vllm

NAME = "tiny-b"  # the demo pair's second engine (conftest.demo_pair), shared
IDLE_S = 0.3  # shorter than the 240-token stream below takes on a CPU


@pytest.fixture(scope="module")
def sidecar(demo_pair: DemoPair) -> Iterator[SidecarThread]:
    model = demo_pair.models[NAME]
    side = SidecarThread(attached([model]), swap={"idle_sleep_s": IDLE_S, "min_awake_s": 0.0})
    side.start()
    try:
        yield side
    finally:
        side.stop()
    # It idles out again after any wake: woken by a sidecar that never idles, for the next
    # module over the shared engine.
    with sidecar_over(NAME, model) as api:
        if api.state(NAME)["state"] != "RUNNING":
            r = api.wake(NAME)
            assert r.status_code == 200, r.text


def _ask(side: SidecarThread, max_tokens: int, stream: bool = False) -> httpx.Response:
    assert side.gateway_url is not None  # idle sleep turns the gateway on: it wakes the model
    body = {
        "model": NAME,
        "prompt": "hello world, this is",
        "max_tokens": max_tokens,
        "temperature": 0.0,
        "ignore_eos": True,
        "stream": stream,
    }
    return httpx.post(f"{side.gateway_url}/v1/completions", json=body, timeout=180)


def _wait_idle_sleeps(api: Api, want: float, timeout_s: float = 10.0) -> None:
    """The sleep is counted once its sequence returns, a moment after the state flips."""
    deadline = time.monotonic() + timeout_s
    while (got := api.metric("hotswap_sleeps_total", model=NAME, reason="idle")) != want:
        assert time.monotonic() < deadline, f"idle sleeps {got}, not {want}"
        time.sleep(0.05)


def test_an_idle_engine_sleeps_and_the_next_request_wakes_it(sidecar: SidecarThread) -> None:
    api = Api(sidecar.base_url)
    first = api.state(NAME)
    assert first["fleet"]["idle_sleep_s"] == IDLE_S
    sidecar.wait_state(NAME, "SUSPENDED", timeout_s=60)
    # Not before its time, read from the record (not from when this test began to look: on
    # a busy machine the fixture's start can take longer than the idle time itself).
    slept_at = api.state(NAME)["fleet"]["idle_slept_at"]
    assert slept_at is not None
    if first["state"] == "RUNNING":
        assert slept_at - first["since"] >= IDLE_S
    _wait_idle_sleeps(api, 1)
    assert httpx.get(f"{sidecar.base_url}/health", timeout=10).status_code == 200  # swappable
    r = _ask(sidecar, 4)
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["text"]
    assert api.metric("hotswap_swaps_total", model=NAME, result="ok") >= 1  # it was woken


def test_never_while_a_request_streams(sidecar: SidecarThread) -> None:
    api = Api(sidecar.base_url)
    sidecar.wait_state(NAME, "SUSPENDED", timeout_s=60)
    before = api.metric("hotswap_sleeps_total", model=NAME, reason="idle")
    t0 = time.monotonic()
    r = _ask(sidecar, 240, stream=True)  # wakes it, then streams for several idle periods
    took = time.monotonic() - t0
    ended = time.time()
    assert r.status_code == 200, r.text
    assert r.text.rstrip().endswith("data: [DONE]")
    assert '"finish_reason":"abort"' not in r.text.replace(" ", "")
    # Longer than an idle period: unguarded, the model would have idled out under it (the
    # 240 tokens are all max_model_len allows; a fast machine streams them in about 0.6 s).
    assert took > IDLE_S, f"the stream took {took:.2f} s: too short to show anything"
    sidecar.wait_state(NAME, "SUSPENDED", timeout_s=60)  # and idles out after it
    _wait_idle_sleeps(api, before + 1)
    decided = api.state(NAME)["fleet"]["idle_slept_at"]
    assert decided >= ended - 0.05, "the idle sleep was decided before the stream ended"
