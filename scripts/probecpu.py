"""Server CPU per probe of a running `hotswap serve`, for one checkout or several side by side.

    python3 scripts/probecpu.py [--n 2000] [--rounds 8] [--path /livez] [CHECKOUT ...]

Each round starts `python -m controller serve` (no models, control port only) from each
CHECKOUT in turn (default: this one; pass an older one, e.g. a `git worktree` of the commit
before, to compare under the same load), sends 200 warm-up requests, then `--n` sequential
GETs of `--path`, each on a new connection as the kubelet's probes are, and reads the
server's user + system CPU from /proc/PID/stat around them; the same wall time idle after
is read too and subtracted. Prints each run and, per checkout, the median and the fastest
run's microseconds of server CPU per request. On a shared machine the runs spread widely
(other processes' load slows this one's CPU too): compare medians of interleaved rounds.
"""

from __future__ import annotations

import argparse
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def cpu_s(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def get(port: int, request: bytes) -> None:
    with socket.create_connection(("127.0.0.1", port), timeout=10) as s:
        s.sendall(request)
        answer = b""
        while chunk := s.recv(65536):
            answer += chunk
    if not answer.startswith(b"HTTP/1.1 200"):
        raise SystemExit(f"the server answered {answer[:80]!r}")


def one_run(checkout: Path, n: int, path: str, workdir: Path) -> float:
    """Microseconds of the server's CPU per request, its idle CPU subtracted."""
    port = free_port()
    config = workdir / f"serve-{port}.yaml"
    config.write_text(f"server:\n  port: {port}\nmodels: []\n")
    env = {**os.environ, "PYTHONPATH": str(checkout)}
    with open(workdir / "serve.log", "a") as log:
        server = subprocess.Popen(
            [sys.executable, "-m", "controller", "serve", "--config", str(config)],
            cwd=checkout,  # `-m` puts the working directory first on sys.path
            env=env,
            stdout=subprocess.DEVNULL,
            stderr=log,
        )
    request = (
        f"GET {path} HTTP/1.1\r\nHost: probe\r\nUser-Agent: kube-probe/1.30\r\n"
        "Connection: close\r\n\r\n"
    ).encode()
    try:
        for _ in range(600):
            try:
                get(port, request)
                break
            except OSError:
                time.sleep(0.05)
        for _ in range(200):
            get(port, request)
        time.sleep(0.5)
        c0, t0 = cpu_s(server.pid), time.monotonic()
        for _ in range(n):
            get(port, request)
        c1, wall = cpu_s(server.pid), time.monotonic() - t0
        time.sleep(wall)
        idle = cpu_s(server.pid) - c1
        return (c1 - c0 - idle) / n * 1e6
    finally:
        server.terminate()
        server.wait(30)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("checkouts", nargs="*", type=Path, default=[ROOT])
    parser.add_argument("--n", type=int, default=2000)
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument("--path", default="/livez")
    args = parser.parse_args()
    runs: dict[Path, list[float]] = {c: [] for c in args.checkouts}
    with tempfile.TemporaryDirectory(prefix="probecpu-") as tmp:
        for r in range(args.rounds):
            for checkout in args.checkouts:
                us = one_run(checkout.resolve(), args.n, args.path, Path(tmp))
                runs[checkout].append(us)
                print(f"round {r + 1} {checkout}: {us:.0f} us per {args.path}", flush=True)
    load = os.getloadavg()[0]
    print(f"server CPU per GET {args.path} (n={args.n}, {args.rounds} rounds, load {load:.1f}):")
    for checkout, values in runs.items():
        print(
            f"  {checkout}: median {statistics.median(values):.0f} us, fastest {min(values):.0f} us"
        )


if __name__ == "__main__":
    main()
