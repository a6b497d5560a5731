"""The launcher and its keeper, with real processes and no vLLM: a managed engine's argv
(its socket, never an address), the private socket folder, the identity check of
`wait_ready`, and the keeper ending the engine's whole process group when its parent dies."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import socket
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from controller.engines import reaper
from controller.engines.enginespec import WORKER_ENV, EngineSpec
from controller.engines.launcher import EngineProcess
from controller.engines.sockets import private_dir, process_group, socket_path, socket_peer_pid
from controller.errors import EngineStartError
from worker_ext import settings as worker_settings

# A stand-in engine: answers GET /health on its Unix socket (stdlib only, starts in ~50 ms),
# and forks a child that sleeps, like vLLM's EngineCore beside its API server. It writes its
# pids to a file so a test can look for them afterwards.
FAKE_ENGINE = textwrap.dedent(
    """
    import http.server, os, socketserver, sys, time
    uds, pids = sys.argv[1], sys.argv[2]
    child = os.fork()
    if child == 0:
        while True:
            time.sleep(1)
    with open(pids, "w") as f:
        f.write(f"{os.getpid()} {child}")
    class H(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            self.send_response(200 if self.path == "/health" else 404)
            self.send_header("content-length", "0")
            self.end_headers()
        def address_string(self):
            return "uds"
        def log_message(self, *a):
            pass
    class S(socketserver.UnixStreamServer):
        pass
    S(uds, H).serve_forever()
    """
)


def fake_spec(folder: Path, name: str = "m") -> EngineSpec:
    uds = socket_path(folder, name)
    pids = folder / f"{name}.pids"
    return EngineSpec(
        model=Path(),
        uds=uds,
        served_model_name=name,
        command=(sys.executable, "-c", FAKE_ENGINE, str(uds), str(pids)),
    )


def alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
    except OSError:
        return False
    return stat[stat.rfind(b")") + 2 :].split()[0] != b"Z"


def wait_gone(pids: list[int], timeout_s: float = 20.0) -> list[int]:
    deadline = time.monotonic() + timeout_s
    while (left := [p for p in pids if alive(p)]) and time.monotonic() < deadline:
        time.sleep(0.05)
    return left


@pytest.fixture
def folder(tmp_path: Path) -> Iterator[Path]:
    # Short: a Unix socket path has at most 107 bytes, pytest's tmp_path can be longer.
    d = private_dir()
    try:
        yield d
    finally:
        for p in d.iterdir():
            p.unlink()
        d.rmdir()


def test_from_command_serves_on_the_socket_and_refuses_addresses(tmp_path: Path) -> None:
    uds = tmp_path / "m.sock"
    spec = EngineSpec.from_command("m", ["python", "-m", "vllm.x"], uds, {"A": "1"})
    assert spec.command == ("python", "-m", "vllm.x", "--uds", str(uds))
    for flag in ("--host=127.0.0.1", "--port=8001", "--uds=/x.sock"):
        with pytest.raises(ValueError, match="chooses the engine's socket"):
            EngineSpec.from_command("m", ["vllm.x", flag], uds, {})
    argv = EngineSpec(model=Path("/m"), uds=uds, served_model_name="m").argv()
    assert argv[argv.index("--uds") + 1] == str(uds)
    assert "--port" not in argv
    assert "--host" not in argv


def test_the_socket_folder_is_private(tmp_path: Path) -> None:
    made = private_dir()
    try:
        assert made.stat().st_mode & 0o777 == 0o700
    finally:
        made.rmdir()
    given = tmp_path / "sockets"
    given.mkdir(mode=0o755)
    assert private_dir(given).stat().st_mode & 0o777 == 0o700  # tightened
    (tmp_path / "link").symlink_to(given)
    with pytest.raises(EngineStartError, match="not a plain folder"):
        private_dir(tmp_path / "link")
    with pytest.raises(EngineStartError, match="longer than"):
        socket_path(tmp_path, "x" * 120)


def test_an_engine_in_an_open_folder_is_not_started(tmp_path: Path) -> None:
    open_dir = tmp_path / "open"
    open_dir.mkdir(mode=0o755)
    os.chmod(open_dir, 0o755)
    engine = EngineProcess(fake_spec(open_dir), tmp_path / "m.log")
    with pytest.raises(EngineStartError, match="must be 0700"):
        engine.start()


def test_wait_ready_takes_only_its_own_process_for_the_engine(folder: Path, tmp_path: Path) -> None:
    """Another server answers /health 200 on the engine's socket (an orphan of an earlier
    run, say): the engine is not ready through it; once the engine itself listens, it is."""
    spec = fake_spec(folder)

    def impostor() -> subprocess.Popen[bytes]:
        proc = subprocess.Popen(
            [sys.executable, "-c", FAKE_ENGINE, str(spec.uds), str(folder / "impostor.pids")],
            start_new_session=True,  # its forked child goes with it (killpg below)
        )
        deadline = time.monotonic() + 10
        while not spec.uds.exists() and time.monotonic() < deadline:
            time.sleep(0.02)
        return proc

    first = impostor()
    # An engine that never serves: only an impostor can answer on its socket.
    silent = EngineSpec(
        model=Path(),
        uds=spec.uds,
        served_model_name="m",
        command=(sys.executable, "-c", "import time; time.sleep(60)"),
    )
    quiet = EngineProcess(silent, tmp_path / "q.log")
    quiet.start()  # unlinks the socket it finds: the first impostor is unreachable now
    second = impostor()  # and binds the path again, answering 200
    try:
        with httpx.Client(transport=httpx.HTTPTransport(uds=str(spec.uds))) as c:
            assert c.get("http://x/health").status_code == 200  # it does answer
        assert not quiet.ping()
        with pytest.raises(EngineStartError, match="not ready after 1 s"):
            quiet.wait_ready(timeout_s=1.0, interval_s=0.1)
    finally:
        quiet.stop(grace_s=2.0)
        for p in (first, second):
            os.killpg(p.pid, signal.SIGKILL)
            p.wait()
    engine = EngineProcess(spec, tmp_path / "m.log")
    engine.start()
    try:
        assert engine.wait_ready(timeout_s=20.0, interval_s=0.05) < 20.0
        assert engine.ping()
    finally:
        engine.stop(grace_s=2.0)


def test_stop_ends_the_whole_group(folder: Path, tmp_path: Path) -> None:
    spec = fake_spec(folder)
    engine = EngineProcess(spec, tmp_path / "m.log")
    engine.start()
    engine.wait_ready(timeout_s=20.0, interval_s=0.05)
    server, child = map(int, (folder / "m.pids").read_text().split())
    assert process_group(server) == process_group(child) == engine.pid
    engine.stop(grace_s=2.0)
    assert wait_gone([server, child, engine.pid or 0]) == []
    assert not spec.uds.exists()


def test_the_engine_runs_below_the_sidecars_priority_in_its_session(
    folder: Path, tmp_path: Path
) -> None:
    """The keeper lowers the engine's CPU priority by `nice` (the engine and its children
    inherit it), and the engine stays in the sidecar's session: where the kernel shares the
    CPU out by session (autogroup), a session of its own would weigh as much as the sidecar's
    whole, and no nice value would put the engine behind the sidecar."""
    mine = os.getpriority(os.PRIO_PROCESS, 0)
    engine = EngineProcess(fake_spec(folder), tmp_path / "m.log", nice=7)
    engine.start()
    try:
        engine.wait_ready(timeout_s=20.0, interval_s=0.05)
        server, child = map(int, (folder / "m.pids").read_text().split())
        for pid in (engine.pid or 0, server, child):
            assert os.getpriority(os.PRIO_PROCESS, pid) == min(19, mine + 7), pid
            assert os.getsid(pid) == os.getsid(0), pid
            assert process_group(pid) == engine.pid, pid
    finally:
        engine.stop(grace_s=2.0)
    plain = EngineProcess(fake_spec(folder, "p"), tmp_path / "p.log")  # nice=0: as the sidecar
    plain.start()
    try:
        plain.wait_ready(timeout_s=20.0, interval_s=0.05)
        server, _ = map(int, (folder / "p.pids").read_text().split())
        assert os.getpriority(os.PRIO_PROCESS, server) == mine
    finally:
        plain.stop(grace_s=2.0)


def test_an_exit_is_told_by_the_kernel_not_found_by_a_poll(folder: Path, tmp_path: Path) -> None:
    """`exited()` returns once the engine's group is killed from outside (a crash, the OOM
    killer), with the keeper's code, and not before: the supervisor awaits it instead of
    looking at the process on a timer."""
    engine = EngineProcess(fake_spec(folder), tmp_path / "m.log")
    engine.start()

    async def body() -> int | None:
        waiter = asyncio.ensure_future(engine.exited())
        done, _ = await asyncio.wait({waiter}, timeout=0.5)
        assert not done, "exited() returned while the engine runs"
        engine.wait_ready(timeout_s=20.0, interval_s=0.05)
        assert engine.pid is not None
        os.killpg(engine.pid, signal.SIGKILL)
        return await asyncio.wait_for(waiter, 10)

    try:
        code = asyncio.run(body())
    finally:
        engine.kill()
    assert code == -signal.SIGKILL
    assert not engine.is_alive()
    assert asyncio.run(engine.exited()) == code  # already gone: at once


SIDECAR = textwrap.dedent(
    """
    import sys, threading, time
    from pathlib import Path
    from controller.engines.enginespec import EngineSpec
    from controller.engines.launcher import EngineProcess
    uds, pids, log = Path(sys.argv[1]), sys.argv[2], Path(sys.argv[3])
    spec = EngineSpec(model=Path(), uds=uds, served_model_name="m",
                      command=(sys.executable, "-c", sys.argv[4], str(uds), pids))
    engine = EngineProcess(spec, log, stop_grace_s=2.0)
    engine.start()
    engine.wait_ready(timeout_s=20.0, interval_s=0.05)
    print(engine.pid, flush=True)
    time.sleep(600)
    """
)


def test_a_sigkilled_sidecar_leaves_no_engine_behind(folder: Path, tmp_path: Path) -> None:
    """The sidecar (here a small process that starts one engine the supervisor's way) is
    SIGKILLed: its engine's keeper gets its parent-death signal and ends the whole group,
    the engine's own child included."""
    uds = socket_path(folder, "m")
    pids = folder / "m.pids"
    sidecar = subprocess.Popen(
        [sys.executable, "-c", SIDECAR, str(uds), str(pids), str(tmp_path / "m.log"), FAKE_ENGINE],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert sidecar.stdout is not None
        keeper = int(sidecar.stdout.readline())
        server, child = map(int, pids.read_text().split())
        assert all(alive(p) for p in (keeper, server, child))
        sidecar.send_signal(signal.SIGKILL)
        sidecar.wait(10)
        assert wait_gone([keeper, server, child]) == []
    finally:
        sidecar.kill()
        sidecar.wait()


SIDECAR_GONE_AT_ONCE = textwrap.dedent(
    """
    import os, sys
    from pathlib import Path
    from controller.engines.enginespec import EngineSpec
    from controller.engines.launcher import EngineProcess
    uds, pids, log = Path(sys.argv[1]), sys.argv[2], Path(sys.argv[3])
    spec = EngineSpec(model=Path(), uds=uds, served_model_name="m",
                      command=(sys.executable, "-c", sys.argv[4], str(uds), pids))
    engine = EngineProcess(spec, log, stop_grace_s=2.0)
    engine.start()
    print(engine.pid, flush=True)
    os._exit(0)  # before the keeper's interpreter has even asked for its death signal
    """
)


def test_a_sidecar_gone_before_the_keeper_asked_for_its_death_signal_leaves_nothing(
    folder: Path, tmp_path: Path
) -> None:
    """The start-up race: the sidecar dies between the fork and the keeper's prctl. The
    keeper compares the parent it has then with the sidecar's pid it was given; it used to
    take whoever was its parent by then for the sidecar, and it and the engine lived on."""
    uds = socket_path(folder, "m")
    pids = folder / "m.pids"
    sidecar = subprocess.run(
        [
            sys.executable,
            "-c",
            SIDECAR_GONE_AT_ONCE,
            str(uds),
            str(pids),
            str(tmp_path / "m.log"),
            FAKE_ENGINE,
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )
    keeper = int(sidecar.stdout.split()[0])
    time.sleep(2.0)  # time for a keeper that missed the race to start its engine
    left = wait_gone([keeper], timeout_s=20.0)
    found = [int(p) for p in pids.read_text().split()] if pids.exists() else []
    try:
        assert left == []
        assert wait_gone(found, timeout_s=10.0) == []
    finally:
        for pid in [keeper, *found]:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)


def test_a_keeper_killed_outright_leaves_its_group_to_be_ended(
    folder: Path, tmp_path: Path
) -> None:
    """SIGKILL of the keeper alone: the engine (its child) gets its own death signal, the
    engine's child (EngineCore's place) lives on in the group. `group_left` names it and
    `stop` ends it although the keeper is gone (the supervisor does both before a new
    start)."""
    engine = EngineProcess(fake_spec(folder), tmp_path / "m.log", stop_grace_s=2.0)
    engine.start()
    try:
        engine.wait_ready(timeout_s=20.0, interval_s=0.05)
        server, child = map(int, (folder / "m.pids").read_text().split())
        assert engine.pid is not None
        os.kill(engine.pid, signal.SIGKILL)
        assert wait_gone([engine.pid, server]) == []
        assert engine.group_left() == [child]
        engine.stop(grace_s=2.0)
        assert wait_gone([child]) == []
        assert engine.group_left() == []
    finally:
        engine.kill()


def test_the_keeper_dies_with_the_thread_that_started_it(folder: Path, tmp_path: Path) -> None:
    """PR_SET_PDEATHSIG follows the starting thread: started from a short-lived thread, the
    engine goes when that thread ends (why the supervisor starts engines on the loop's)."""
    engine = EngineProcess(fake_spec(folder), tmp_path / "m.log", stop_grace_s=2.0)
    started, done = threading.Event(), threading.Event()

    def starter() -> None:
        engine.start()
        started.set()
        done.wait(30)  # the thread outlives the keeper's start-up, then ends

    t = threading.Thread(target=starter)
    t.start()
    try:
        assert started.wait(10)
        engine.wait_ready(timeout_s=20.0, interval_s=0.05)
        server, child = map(int, (folder / "m.pids").read_text().split())
    finally:
        done.set()
        t.join()
    assert engine.pid is not None
    assert wait_gone([engine.pid, server, child]) == []
    engine.kill()


def test_the_keeper_exits_with_the_engines_code_and_ends_the_group(tmp_path: Path) -> None:
    pids = tmp_path / "pids"
    script = (
        "import os, sys, time\n"
        "c = os.fork()\n"
        "if c == 0:\n    time.sleep(60)\n"
        f"open({str(pids)!r}, 'w').write(str(c)); sys.exit(3)\n"
    )
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "controller.engines.reaper",
            "2",
            str(os.getpid()),
            "--",
            sys.executable,
            "-c",
            script,
        ],
        start_new_session=True,
        timeout=30,
    )
    assert proc.returncode == 3
    assert wait_gone([int(pids.read_text())]) == []
    assert reaper.main(["2"]) == 2  # usage


def test_a_server_already_on_the_socket_cannot_keep_the_engine_from_binding(
    folder: Path, tmp_path: Path
) -> None:
    """The CI failure of old (an engine's port taken by another engine, the restart on the
    same port, the model FAILED for good) has no counterpart: whatever holds the socket path
    when an engine starts, alive or not, the engine gets a fresh socket there and is ready,
    start after start."""
    spec = fake_spec(folder)
    squatter = subprocess.Popen(
        [sys.executable, "-c", FAKE_ENGINE, str(spec.uds), str(folder / "squatter.pids")],
        start_new_session=True,  # its forked child goes with it (killpg below)
    )
    try:
        deadline = time.monotonic() + 10
        while not spec.uds.exists() and time.monotonic() < deadline:
            time.sleep(0.02)
        for attempt in range(2):  # a start, then a restart on the same path
            engine = EngineProcess(spec, tmp_path / f"m{attempt}.log")
            engine.start()
            try:
                assert engine.wait_ready(timeout_s=20.0, interval_s=0.05) < 20.0
                with socket.socket(socket.AF_UNIX) as s:
                    s.connect(str(spec.uds))
                    assert engine.owns(socket_peer_pid(s))
            finally:
                engine.stop(grace_s=2.0)
        assert squatter.poll() is None  # still alive, just unreachable
    finally:
        os.killpg(squatter.pid, signal.SIGKILL)
        squatter.wait()


def test_engines_inherit_no_sidecar_secret() -> None:
    """Managed mode: the sidecar's environment (its token above all) never reaches vLLM; the
    worker extension's own settings and the model's explicit env do."""
    sidecar_env = {
        "PATH": "/usr/bin",
        "HOTSWAP_AUTH__TOKEN": "s3cret",
        "HOTSWAP_AUTH__TOKEN_FILE": "/run/secrets/token",
        "HOTSWAP_TOKEN": "s3cret",
        "HOTSWAP_SERVER__HOST": "0.0.0.0",
        "HOTSWAP_CONFIG_FILE": "/etc/hotswap/models.yaml",
        "HOTSWAP_KEEP_HOST_BACKUP": "0",
        "HOTSWAP_HOST_CODEC": "none",
        "HOTSWAP_MAP_IMPL": "vllm",  # a worker variable retired: nothing reads it
    }
    spec = EngineSpec.from_command(
        "m", ["vllm.x"], Path("/s/m.sock"), {"HOTSWAP_VERIFY_KERNEL": "off"}
    )
    env = spec.env(sidecar_env)
    assert "s3cret" not in env.values()
    hotswap = {k: v for k, v in env.items() if k.startswith("HOTSWAP_")}
    assert hotswap == {
        "HOTSWAP_KEEP_HOST_BACKUP": "0",
        "HOTSWAP_HOST_CODEC": "none",
        "HOTSWAP_VERIFY_KERNEL": "off",
    }
    assert env["PATH"] == "/usr/bin"


def test_the_allow_list_is_the_worker_settings() -> None:
    """The allow-list is exactly the variables the worker extension reads (its one list,
    worker_ext.settings.VARIABLES): each passes from the sidecar's environment to the
    engines it starts (the codec's and the disk tier's were once left behind), and no
    retired one does."""
    read = set(worker_settings.names())
    assert read == WORKER_ENV, (sorted(read - WORKER_ENV), sorted(WORKER_ENV - read))
    env = EngineSpec.from_command("m", ["vllm.x"], Path("/s/m.sock"), {}).env(
        {name: "1" for name in read}
    )
    assert read <= set(env), sorted(read - set(env))


def test_a_port_is_for_benchmarks_and_the_sidecar_process_only(tmp_path: Path) -> None:
    """TCP stays for what the benchmarks launch on a device of their own (an engine, the
    sidecar process itself); a managed model never gets it (its settings refuse a port)."""
    spec = EngineSpec.from_command("sidecar", ["hotswap", "serve"], 8800, {})
    assert spec.command == ("hotswap", "serve", "--host", "127.0.0.1", "--port", "8800")
    assert spec.base_url == "http://127.0.0.1:8800"
    argv = EngineSpec(model=Path("/m"), port=8001, served_model_name="m").argv()
    assert argv[argv.index("--port") + 1] == "8001"
    assert "--uds" not in argv
    with pytest.raises(ValueError, match="exactly one"):
        EngineSpec(model=Path("/m"), served_model_name="m")
    with pytest.raises(ValueError, match="exactly one"):
        EngineSpec(model=Path("/m"), served_model_name="m", uds=tmp_path / "s", port=1)
