"""How the kernel's CPU sharing treats a busy `hotswap serve` beside CPU-bound processes
placed as a managed engine may be: `/livez` latency and the loop thread's wait for a CPU.

    python3 scripts/schedlivez.py [--seconds 20] [--burners 4] [ARRANGEMENT ...]

A `hotswap serve` (no models, control port only) runs in this script's session; a client
in a session of its own keeps its loop busy (GET /metrics on new connections, back to
back); this script probes `GET /livez` every 50 ms on new connections. For each
arrangement, `--burners` busy loops (`while True: pass`) run for `--seconds`:

- `same_session`: in the serve's session, at its priority;
- `same_session_nice10`: in its session at nice 10 (managed engines since engine_nice);
- `own_sessions`: each in a session of its own (managed engines before: start_new_session);
- `own_sessions_nice10`: each in a session of its own at nice 10;
- `own_sessions_autogroup10`: each in a session of its own whose autogroup is at nice 10.

Printed per arrangement: the probes' p50, p99 and max (ms) and the serve's loop thread's
seconds on a CPU and runnable but waiting for one (/proc/PID/schedstat). Where the kernel
groups a session's processes for CPU (autogroup: /proc/sys/kernel/sched_autogroup_enabled
is 1 and the processes are in the root CPU cgroup), a nice value orders processes only
within one session. The machine's other load adds to every figure: interleave runs.
"""

from __future__ import annotations

import argparse
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
ARRANGEMENTS = {  # name: (a session of its own, nice, its autogroup's nice or None)
    "same_session": (False, 0, None),
    "same_session_nice10": (False, 10, None),
    "own_sessions": (True, 0, None),
    "own_sessions_nice10": (True, 10, None),
    "own_sessions_autogroup10": (True, 10, 10),
}
BUSY = """
import socket, sys, time
port = int(sys.argv[1])
while True:
    s = socket.create_connection(("127.0.0.1", port))
    s.sendall(b"GET /metrics HTTP/1.1\\r\\nHost: p\\r\\nConnection: close\\r\\n\\r\\n")
    while s.recv(65536):
        pass
    s.close()
    time.sleep(0.004)
"""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def sched(pid: int) -> tuple[float, float]:
    on_cpu, waiting, _ = Path(f"/proc/{pid}/schedstat").read_text().split()
    return int(on_cpu) / 1e9, int(waiting) / 1e9


def burner(own_session: bool, nice: int, autogroup: int | None) -> subprocess.Popen[bytes]:
    def lower() -> None:  # in the child, after its setsid
        if autogroup is not None:
            Path("/proc/self/autogroup").write_text(str(autogroup))
        if nice:
            os.nice(nice)

    return subprocess.Popen(
        [sys.executable, "-c", "while True: pass"], start_new_session=own_session, preexec_fn=lower
    )


def probe(port: int) -> float:
    t0 = time.monotonic()
    with socket.create_connection(("127.0.0.1", port), timeout=10) as s:
        s.sendall(b"GET /livez HTTP/1.1\r\nHost: p\r\nConnection: close\r\n\r\n")
        answer = b""
        while chunk := s.recv(65536):
            answer += chunk
    if not answer.startswith(b"HTTP/1.1 200"):
        raise SystemExit(f"the server answered {answer[:80]!r}")
    return time.monotonic() - t0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("arrangements", nargs="*", default=list(ARRANGEMENTS))
    parser.add_argument("--seconds", type=float, default=20.0)
    parser.add_argument("--burners", type=int, default=4)
    args = parser.parse_args()
    port = free_port()
    workdir = Path(tempfile.mkdtemp(prefix="schedlivez-"))
    config = workdir / "serve.yaml"
    config.write_text(f"server:\n  port: {port}\nmodels: []\n")
    server = subprocess.Popen(
        [sys.executable, "-m", "controller", "serve", "--config", str(config)],
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    busy = None
    try:
        for _ in range(600):
            try:
                probe(port)
                break
            except OSError:
                time.sleep(0.05)
        busy = subprocess.Popen([sys.executable, "-c", BUSY, str(port)], start_new_session=True)
        for name in args.arrangements:
            burners = [burner(*ARRANGEMENTS[name]) for _ in range(args.burners)]
            try:
                time.sleep(1.0)
                took: list[float] = []
                (c0, w0), t0 = sched(server.pid), time.monotonic()
                while time.monotonic() - t0 < args.seconds:
                    took.append(probe(port))
                    time.sleep(0.05)
                c1, w1 = sched(server.pid)
            finally:
                for b in burners:
                    b.kill()
                    b.wait()
            took.sort()
            n = len(took)
            print(
                f"{name:26s} n={n} p50 {took[n // 2] * 1e3:6.1f} ms  p99 "
                f"{took[int(n * 0.99)] * 1e3:6.1f} ms  max {took[-1] * 1e3:6.1f} ms  loop on a "
                f"CPU {c1 - c0:5.2f} s, waiting {w1 - w0:5.2f} s  (load {os.getloadavg()[0]:.1f})",
                flush=True,
            )
            time.sleep(1.0)
    finally:
        if busy is not None:
            busy.kill()
            busy.wait()
        server.send_signal(signal.SIGTERM)
        server.wait(20)
        for p in workdir.iterdir():
            p.unlink()
        workdir.rmdir()
    return 0


if __name__ == "__main__":
    sys.exit(main())
