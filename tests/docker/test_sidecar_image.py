"""The sidecar image, built from docker/sidecar.Dockerfile as users build it, run against a real
CPU vLLM server on the host's network (attached mode): a sleep and a wake through the
container's API with the token from the environment, readiness as outside a container, as a
non-root user on a read-only root filesystem."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import httpx
import imagetools
import pytest

from controller.engines.launcher import EngineProcess
from controller.engines.sockets import free_port

if TYPE_CHECKING:
    from imagetools import Images
    from support.engines import EngineLauncher
    from support.models import ModelFactory

pytestmark = pytest.mark.vllm

TAG = "localhost/vllm-hotswap-sidecar:ci"
NAME = "tiny"
TOKEN = "image-test-token"
AUTH = {"Authorization": f"Bearer {TOKEN}"}
UID = 10001
SIZE_BOUND = 600e6  # no torch, no vLLM: a Python base and the controller's dependencies


@pytest.fixture(scope="module")
def image(images: Images) -> imagetools.Build:
    return images.build("sidecar.Dockerfile", TAG)


@pytest.fixture(scope="module")
def engine(engines: EngineLauncher, tiny_model: ModelFactory) -> EngineProcess:
    return engines.start(tiny_model("llama", 0, True), NAME)


@pytest.fixture(scope="module")
def sidecar(
    image: imagetools.Build, engine: EngineProcess, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[imagetools.Container, str]]:
    port = free_port()
    log = tmp_path_factory.mktemp("sidecar-container") / "container.log"
    address, mounts = _engine_address(engine)
    with imagetools.container(
        image.tag,
        # The image's own command, on loopback (the host's network is shared) and attached.
        *("serve", "--host", "127.0.0.1", "--port", str(port)),
        *("--engine", f"{NAME}={address}"),
        log=log,
        env={"HOTSWAP_AUTH__TOKEN": TOKEN},
        # Nothing writable at all: no tmpfs either.
        options=("--read-only", "--read-only-tmpfs=false", "--cap-drop=all", *mounts),
    ) as box:
        url = f"http://127.0.0.1:{port}"
        _wait_running(box, url)
        yield box, url


def _engine_address(engine: EngineProcess) -> tuple[str, tuple[str, ...]]:
    """How the container reaches the engine: its URL, or its Unix socket with the socket's
    folder mounted in (`U`: handed to the container's user, who must be able to enter it)."""
    uds = getattr(engine.spec, "uds", None)
    if uds is None:
        return engine.base_url, ()
    folder = Path(uds).parent
    return f"unix:{uds}", ("--volume", f"{folder}:{folder}:U")


def _engine_health(engine: EngineProcess) -> int:
    uds = getattr(engine.spec, "uds", None)
    transport = httpx.HTTPTransport(uds=str(uds)) if uds is not None else None
    with httpx.Client(transport=transport, timeout=10.0) as client:
        return client.get(f"{engine.base_url}/health").status_code


def _wait_running(box: imagetools.Container, url: str, timeout_s: float = 180.0) -> None:
    deadline = time.monotonic() + timeout_s
    last = "no answer"
    while time.monotonic() < deadline:
        if not box.running():
            pytest.fail(f"the sidecar container exited:\n{box.logs_tail()}")
        try:
            r = httpx.get(f"{url}/models/{NAME}", headers=AUTH, timeout=5.0)
            last = r.text
            if r.status_code == 200 and r.json()["state"] == "RUNNING":
                return
        except httpx.HTTPError as exc:
            last = repr(exc)
        time.sleep(0.5)
    pytest.fail(f"the sidecar in the container never saw {NAME} RUNNING: {last}\n{box.logs_tail()}")


def test_the_image_is_small_and_runs_as_its_non_root_user(image: imagetools.Build) -> None:
    assert image.size_bytes < SIZE_BOUND, f"{image.size_bytes / 1e6:.0f} MB"
    config = imagetools.image_config(image.tag)
    assert config.get("User") == f"{UID}:{UID}", config
    assert config.get("Entrypoint") == ["hotswap"], config


def test_the_container_is_non_root_on_a_read_only_root(
    sidecar: tuple[imagetools.Container, str],
) -> None:
    box, _ = sidecar
    ids = box.exec("id", "-u")
    assert ids.returncode == 0, ids.stderr
    assert ids.stdout.strip() == str(UID)
    assert box.inspect()["HostConfig"]["ReadonlyRootfs"] is True  # type: ignore[index]
    for path in ("/probe", "/tmp/probe", "/usr/local/lib/probe"):
        wrote = box.exec("sh", "-c", f": > {path}")
        assert wrote.returncode != 0, f"{path} was writable"
        assert "Read-only file system" in wrote.stderr, wrote.stderr


def test_sleep_and_wake_through_the_container_with_the_token_from_its_environment(
    sidecar: tuple[imagetools.Container, str], engine: EngineProcess
) -> None:
    _, url = sidecar
    # Control routes require the token; the environment gave it, so a bare request is refused.
    refused = httpx.post(f"{url}/models/{NAME}/sleep", json={"level": 1}, timeout=30.0)
    assert refused.status_code == 401, refused.text
    assert httpx.get(f"{url}/livez", timeout=10.0).status_code == 200
    assert httpx.get(f"{url}/health", timeout=10.0).status_code == 200

    slept = httpx.post(f"{url}/models/{NAME}/sleep", json={"level": 1}, headers=AUTH, timeout=120.0)
    assert slept.status_code == 200, slept.text
    assert slept.json()["state"] == "SUSPENDED"
    # Readiness as outside a container: the gated model asleep means 503 from the sidecar,
    # while vLLM's own /health stays 200 (it says nothing about sleep).
    health = httpx.get(f"{url}/health", timeout=10.0)
    assert health.status_code == 503, health.text
    assert httpx.get(f"{url}/models/{NAME}/health", timeout=10.0).status_code == 503
    assert _engine_health(engine) == 200

    woke = httpx.post(f"{url}/models/{NAME}/wake", headers=AUTH, timeout=120.0)
    assert woke.status_code == 200, woke.text
    body = woke.json()
    assert body["state"] == "RUNNING"
    assert "resume_and_verify" in [p["name"] for p in body["transition"]["phases"]]
    state = httpx.get(f"{url}/models/{NAME}", headers=AUTH, timeout=10.0).json()
    assert state["verified"] is True, state
    assert httpx.get(f"{url}/health", timeout=10.0).status_code == 200
