"""The checkpoint helper and its sidecar seam, against the file-backed fake driver."""

from __future__ import annotations

import asyncio
import io
import json
import time
from pathlib import Path
from typing import Any

import pytest

from controller.engines import cudackpt
from controller.engines.checkpoint import Checkpointer


@pytest.fixture
def fake(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    (tmp_path / "cuda").write_text("101 1000\n102 2000\n")
    monkeypatch.setenv("HOTSWAP_CUDACKPT_FAKE", str(tmp_path))
    return tmp_path


def call(op: str, *pids: int) -> dict:
    return cudackpt.run(op, list(pids), 500)


def states(fake: Path) -> dict[str, str]:
    return json.loads((fake / "state.json").read_text())


def test_probe_tells_cuda_processes_and_their_bytes(fake: Path) -> None:
    out = call("probe", 100, 101, 102)
    assert out["ok"]
    assert out["pids"][100]["cuda"] is False
    assert out["pids"][101] == {"cuda": True, "state": "running", "bytes": 1000}


def test_a_process_without_a_context_is_left_running(fake: Path) -> None:
    """vLLM's API server runs cuInit (the driver answers for it) and makes no context (NVML
    lists no memory for it): no driver call touches it, the rank's process alone is
    checkpointed and restored, and each call on it is timed."""
    (fake / "cuda").write_text("101 1000\n102 0\n")
    out = call("probe", 101, 102)
    assert out["pids"][102] == {"cuda": False, "state": "running", "bytes": 0, "context": False}
    assert out["pids"][101]["cuda"] is True
    out = call("checkpoint", 101, 102)
    assert out["ok"], out
    assert states(fake) == {"101": "checkpointed"}  # 102 never locked
    assert out["pids"][101]["s"].keys() == {"lock", "checkpoint"}
    assert "s" not in out["pids"][102]
    assert out["pids"][102]["context"] is False  # beside a checkpointed process too
    out = call("state", 101, 102)
    assert [p for p, v in out["pids"].items() if v["cuda"]] == [101]
    out = call("restore", 101, 102)
    assert out["ok"], out
    assert states(fake) == {"101": "running"}
    assert out["pids"][101]["s"].keys() == {"restore", "unlock"}


def test_where_nvml_lists_none_of_them_every_process_the_driver_knows_counts(
    fake: Path,
) -> None:
    """NVML blind to these PIDs (another PID namespace): nothing is left out."""
    (fake / "cuda").write_text("101 0\n102 0\n")
    out = call("checkpoint", 101, 102)
    assert out["ok"], out
    assert states(fake) == {"101": "checkpointed", "102": "checkpointed"}


def test_checkpoint_then_restore_every_process(fake: Path) -> None:
    out = call("checkpoint", 100, 101, 102)
    assert out["ok"], out
    assert states(fake) == {"101": "checkpointed", "102": "checkpointed"}
    assert out["pids"][101]["bytes"] == 0
    out = call("restore", 100, 101, 102)
    assert out["ok"], out
    assert states(fake) == {"101": "running", "102": "running"}


@pytest.mark.parametrize("fail", ["lock 102", "checkpoint 102", "checkpoint"])
def test_a_failure_on_one_process_leaves_every_process_running(fake: Path, fail: str) -> None:
    (fake / "fail").write_text(fail)
    out = call("checkpoint", 101, 102)
    assert not out["ok"]
    assert out["code"] == fail.split()[0]
    assert set(states(fake).values()) == {"running"}


def test_a_failed_rollback_says_so(fake: Path) -> None:
    (fake / "fail").write_text("unlock 101")
    (fake / "cuda").write_text("101\n102\n")
    # 101 locks, 102 cannot (already locked): the rollback unlocks 101, and that fails
    (fake / "state.json").write_text(json.dumps({"102": "locked"}))
    out = call("checkpoint", 101, 102)
    assert not out["ok"]
    assert out["code"] == "rollback"


def test_a_failed_restore_is_reported(fake: Path) -> None:
    assert call("checkpoint", 101, 102)["ok"]
    (fake / "fail").write_text("restore 102")
    out = call("restore", 101, 102)
    assert not out["ok"]
    assert out["code"] == "restore"


@pytest.mark.parametrize(
    ("file", "code"), [("noapi", "no-api"), ("nodriver", "no-driver"), (None, "no-cuda")]
)
def test_incapable(fake: Path, file: str | None, code: str) -> None:
    if file:
        (fake / file).write_text("")
    out = call("checkpoint", 100)
    assert out == {"ok": False, "code": code, "error": out["error"], "elapsed_s": out["elapsed_s"]}


def test_usage(capsys: pytest.CaptureFixture[str]) -> None:
    assert cudackpt.main([]) == 2
    assert cudackpt.main(["freeze", "1"]) == 2
    assert cudackpt.main(["probe", "x"]) == 2


def test_checkpointer_runs_the_helper_as_a_process(fake: Path) -> None:
    ck = Checkpointer(lock_timeout_s=1.0, call_timeout_s=60.0)

    async def go() -> None:
        res = await ck.call("checkpoint", (100, 101))
        assert res.ok
        assert res.by_pid()["driver_by_pid"]["101"].keys() == {"lock", "checkpoint"}
        assert "left_running" not in res.by_pid()
        assert res.init_s is not None
        assert res.probe_s is not None
        assert res.call_s is not None
        assert res.call_s >= res.elapsed_s
        assert {"call_s", "helper_init_s", "probe_s"} <= res.by_pid().keys()
        assert res.cuda_pids == (101,)
        assert res.states == {"checkpointed"}
        assert res.device_bytes == 0
        res = await ck.call("restore", (100, 101))
        assert res.ok
        assert res.states == {"running"}
        none = await ck.call("probe", ())
        assert none.incapable
        assert none.code == "no-pids"
        await ck.aclose()  # the helpers that answered have ended, the spare too

    asyncio.run(go())


def test_a_restore_does_not_wait_for_nvml(fake: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    asked: list[str] = []
    real = cudackpt.FakeDriver.device_bytes

    def counted(self: cudackpt.FakeDriver) -> dict[int, int] | None:
        asked.append("nvml")
        return real(self)

    monkeypatch.setattr(cudackpt.FakeDriver, "device_bytes", counted)
    out = call("checkpoint", 100, 101, 102)
    assert out["ok"]
    assert asked == ["nvml", "nvml"]  # which processes hold a context, then what they hold
    assert out["pids"][101]["bytes"] == 0
    asked.clear()
    out = call("restore", 100, 101, 102)
    assert out["ok"]
    assert asked == []
    assert out["pids"][101]["s"].keys() == {"restore", "unlock"}
    del out["pids"][101]["s"]
    assert out["pids"][101] == {"cuda": True, "state": "running", "bytes": None}
    assert set(out) >= {"elapsed_s", "init_s", "probe_s"}


def test_the_helper_starts_without_site_packages(
    fake: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    seen: list[tuple[str, ...]] = []
    real = asyncio.create_subprocess_exec

    async def spy(*argv: str, **kw: object) -> asyncio.subprocess.Process:
        seen.append(argv)
        return await real(*argv, **kw)  # type: ignore[arg-type]

    monkeypatch.setattr(asyncio, "create_subprocess_exec", spy)

    async def go() -> Any:
        ck = Checkpointer(lock_timeout_s=1.0, call_timeout_s=60.0)
        try:
            return await ck.call("probe", (101,))
        finally:
            await ck.aclose()

    res = asyncio.run(go())
    assert res.ok
    assert res.cuda_pids == (101,)
    assert seen[0][1:4] == ("-S", "-m", "controller.engines.cudackpt")


def test_each_call_is_answered_by_the_helper_started_ahead(fake: Path) -> None:
    ck = Checkpointer(lock_timeout_s=1.0, call_timeout_s=60.0)

    async def go() -> None:
        assert (await ck.call("checkpoint", (101, 102))).ok  # cold: none was ready
        await ck.settle()
        spare = ck._spare
        assert spare is not None
        assert spare.returncode is None  # warm, waiting for its call
        res = await ck.call("restore", (101, 102))
        assert res.ok
        assert res.states == {"running"}
        assert res.idle_s is not None  # the spare answered: it says how long it waited
        assert res.by_pid()["helper_idle_s"] == res.idle_s
        await ck.settle()  # its exit and the refill went on after the answer
        assert spare.returncode == 0  # it answered that call and ended
        nxt = ck._spare
        assert nxt is not None
        assert nxt is not spare
        nxt.kill()  # a spare that died is not used: a fresh helper answers
        await nxt.wait()
        assert (await ck.call("probe", (101,))).cuda_pids == (101,)
        await ck.settle()
        last = ck._spare
        assert last is not None
        await ck.aclose()  # EOF: the spare ends, nothing left behind
        assert last.returncode == 0
        assert ck._spare is None

    asyncio.run(go())


SLOW_EXIT = """#!/bin/sh
# a helper that answers its call at once, then takes its time to end (the driver's teardown)
read -r line || exit 0
echo '{"ok": true, "pids": {"101": {"cuda": true, "state": "running"}}, "elapsed_s": 0.01}'
sleep "$SLOW_EXIT_S"
"""


def test_the_answer_does_not_wait_for_the_helpers_exit(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    helper = tmp_path / "helper"
    helper.write_text(SLOW_EXIT)
    helper.chmod(0o755)
    monkeypatch.setenv("SLOW_EXIT_S", "4")
    ck = Checkpointer(lock_timeout_s=1.0, call_timeout_s=60.0, python=str(helper))

    async def go() -> None:
        t0 = time.monotonic()
        res = await ck.call("restore", (101,))
        answered = time.monotonic() - t0
        assert res.ok
        assert res.states == {"running"}
        assert answered < 2.0  # the old seam waited the helper's 4 s exit out
        assert ck._behind  # its exit still going on
        await ck.aclose()  # waits for them: nothing left behind
        assert not ck._behind
        assert ck._spare is None

    asyncio.run(go())


@pytest.mark.parametrize(
    ("answer", "says"),
    [
        ("echo 'Segmentation fault'", "Segmentation fault"),  # no JSON
        ("head -c 200000 /dev/zero | tr '\\0' x; echo", "too long"),  # past the reader's limit
    ],
)
def test_a_helper_whose_answer_is_no_json_line_is_a_helper_error(
    tmp_path: Path, answer: str, says: str
) -> None:
    helper = tmp_path / "helper"
    helper.write_text(f"#!/bin/sh\nread -r line\n{answer}\n")
    helper.chmod(0o755)
    ck = Checkpointer(lock_timeout_s=1.0, call_timeout_s=60.0, python=str(helper))

    async def go() -> None:
        res = await ck.call("restore", (101,))
        assert not res.ok
        assert res.code == "helper"
        assert says in (res.error or "")
        await ck.aclose()

    asyncio.run(go())


def test_a_warm_helper_reads_its_call_from_stdin_and_ends_at_eof(
    fake: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setattr("sys.stdin", io.StringIO(""))
    assert cudackpt.main(["--warm"]) == 0
    assert capsys.readouterr().out == ""  # closed by the sidecar: no call, no answer
    monkeypatch.setattr("sys.stdin", io.StringIO("checkpoint 500 100 101 102\n"))
    assert cudackpt.main(["--warm"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["ok"]
    assert out["idle_s"] >= 0  # from its start's end to its call's line
    assert states(fake) == {"101": "checkpointed", "102": "checkpointed"}
    monkeypatch.setattr("sys.stdin", io.StringIO("freeze 500 101\n"))
    assert cudackpt.main(["--warm"]) == 2


def test_the_answer_line_is_flushed_before_the_helper_ends(
    fake: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """stdout to a pipe is block-buffered (the sidecar sets no PYTHONUNBUFFERED): unflushed,
    the sidecar would read the answer only at the helper's exit, after libcuda's teardown."""
    raw = io.BytesIO()
    monkeypatch.setattr("sys.stdout", io.TextIOWrapper(raw, line_buffering=False))
    monkeypatch.setattr("sys.stdin", io.StringIO("restore 500 101\n"))
    assert cudackpt.main(["--warm"]) == 0
    line = raw.getvalue().decode()  # what the pipe holds before the process ends
    assert json.loads(line)["ok"] is True


def test_a_warm_helper_without_a_driver_says_so_at_its_call(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.delenv("HOTSWAP_CUDACKPT_FAKE", raising=False)

    def absent() -> None:
        raise cudackpt.DriverError("no-driver", "no CUDA driver: libcuda.so.1 (test)")

    monkeypatch.setattr(cudackpt, "CudaDriver", absent)
    monkeypatch.setattr("sys.stdin", io.StringIO("checkpoint 500 101\n"))
    assert cudackpt.main(["--warm"]) == 1
    out = json.loads(capsys.readouterr().out)
    assert out["code"] == "no-driver"


class FakeNvml:
    """libnvidia-ml as ctypes sees it: one device, one process (pid 7, 5 MiB)."""

    def __init__(self) -> None:
        self.inits = 0

    def nvmlInit_v2(self) -> int:  # the library's names
        self.inits += 1
        return 0

    def nvmlDeviceGetCount_v2(self, ref: Any) -> int:
        ref._obj.value = 1
        return 0

    def nvmlDeviceGetHandleByIndex_v2(self, i: int, ref: Any) -> int:
        return 0

    def nvmlDeviceGetComputeRunningProcesses_v3(self, dev: Any, n: Any, infos: Any) -> int:
        n._obj.value = 1
        infos[0].pid, infos[0].usedGpuMemory = 7, 5 << 20
        return 0


def test_nvml_is_started_once_per_helper(monkeypatch: pytest.MonkeyPatch) -> None:
    lib = FakeNvml()
    monkeypatch.setattr(cudackpt.ctypes, "CDLL", lambda name: lib)
    drv = object.__new__(cudackpt.CudaDriver)  # no libcuda on this machine
    drv._nvml = None
    assert drv.nvml() is lib  # what --warm does ahead of the call
    assert drv.device_bytes() == {7: 5 << 20}
    assert drv.device_bytes() == {7: 5 << 20}
    assert lib.inits == 1  # not started again on the call's path, never shut down
