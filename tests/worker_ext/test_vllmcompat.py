"""The tested vLLM versions and the refusal of the others (docs/contracts.md §1.6)."""

from __future__ import annotations

import pytest

from worker_ext import vllmcompat


def test_tested_versions_pass() -> None:
    assert vllmcompat.refusal("0.26.0", "cuda", allow="") is None
    assert vllmcompat.refusal("0.26.0", "cpu", allow="") is None
    assert vllmcompat.refusal("0.32.0", "cpu", allow="") is None
    assert vllmcompat.refusal("0.26.0+cu130", "cuda", allow="") is None


@pytest.mark.parametrize(
    ("version", "plat"), [("0.33.0", "cpu"), ("0.25.1", "cpu"), ("0.32.0", "cuda"), ("x", "tpu")]
)
def test_an_untested_version_is_refused_with_the_reason(version: str, plat: str) -> None:
    why = vllmcompat.refusal(version, plat, allow="")
    assert why is not None
    assert f"vLLM {version} on {plat} was not tested" in why
    assert vllmcompat.ALLOW_ENV in why


def test_the_override_lets_an_untested_version_through() -> None:
    assert vllmcompat.refusal("0.33.0", "cpu", allow="1") is None


def test_require_raises_for_the_running_vllm_when_untested(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delenv(vllmcompat.ALLOW_ENV, raising=False)
    monkeypatch.setattr(vllmcompat, "vllm_version", lambda: "0.99.0")
    with pytest.raises(RuntimeError, match=r"vLLM 0\.99\.0 on .* was not tested"):
        vllmcompat.require()


def test_the_extension_refuses_every_rpc_on_an_untested_vllm(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Its state is made at the first RPC: there the version is checked, and the answer says
    why (ok false) instead of a wake nobody verified for that allocator."""
    from worker_ext.extension import HotSwapExtension

    monkeypatch.delenv(vllmcompat.ALLOW_ENV, raising=False)
    monkeypatch.setattr(vllmcompat, "vllm_version", lambda: "0.99.0")

    class Bare(HotSwapExtension):
        rank = 0

    rep = Bare().hotswap_info()
    assert rep["ok"] is False
    assert "vLLM 0.99.0" in rep["error"]
    assert "was not tested" in rep["error"]


def test_no_allocator_pool_is_asleep_without_cuda() -> None:
    """CPU: no CuMemAllocator records, so hotswap_info's allocator_asleep is empty."""
    assert vllmcompat.allocator_asleep() == []


def test_vllm_sleep_is_the_bound_hotswap_backends_flag_only() -> None:
    """A worker whose sleep-mode backend is none yet, vLLM's cumem (no such flag), or the
    hotswap backend: only the last says vLLM's own sleep is in force, and only when set."""
    from worker_ext.sleepbackend import HotSwapSleepBackend

    class Worker:
        pass

    class Cumem:
        pass

    w = Worker()
    assert vllmcompat.vllm_sleep(w) is False  # no backend attribute (not a vLLM worker)
    setattr(w, vllmcompat.WORKER_BACKEND_ATTR, None)  # vLLM's worker before its first sleep
    assert vllmcompat.vllm_sleep(w) is False
    setattr(w, vllmcompat.WORKER_BACKEND_ATTR, Cumem())
    assert vllmcompat.vllm_sleep(w) is False
    backend = HotSwapSleepBackend(w)
    setattr(w, vllmcompat.WORKER_BACKEND_ATTR, backend)
    assert vllmcompat.vllm_sleep(w) is False
    backend.vllm_sleep = True
    assert vllmcompat.vllm_sleep(w) is True


def test_hotswap_worker_refuses_to_start_on_an_untested_vllm(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Before vLLM's own worker is built (the model is not loaded): the engine fails to
    start with the reason."""
    from worker_ext import sleepworker

    monkeypatch.delenv(vllmcompat.ALLOW_ENV, raising=False)
    monkeypatch.setattr(vllmcompat, "vllm_version", lambda: "0.99.0")
    cls = sleepworker.worker_class("cpu")
    with pytest.raises(RuntimeError, match=r"vLLM 0\.99\.0 on .* was not tested"):
        cls.__new__(cls).__init__()


def test_the_entry_point_registers_the_backend_in_vllms_factory() -> None:
    """vLLM runs every `vllm.general_plugins` entry point in each of its processes; ours
    registers the name `hotswap`. Runs where the project is installed (scripts/bootstrap.sh
    installs it editable on every call; the version lane imports the checkout instead)."""
    from importlib.metadata import entry_points

    ours = [e for e in entry_points(group="vllm.general_plugins") if e.name == "hotswap"]
    if not ours:
        pytest.skip("vllm-hotswap is not installed in this venv: no entry point to load")
    assert ours[0].value == "worker_ext.plugin:register"
    ours[0].load()()
    from vllm.device_allocator.sleep_mode_backend import SleepModeBackendFactory

    from worker_ext.sleepbackend import HotSwapSleepBackend

    assert SleepModeBackendFactory.get_backend_class("hotswap") is HotSwapSleepBackend
