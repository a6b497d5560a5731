"""Build and run the project's images with podman, bounded, on machines that reach no registry.

What this machine class needs (each found by trying, as a new user would):
- No registry of images is reachable, so the base the Dockerfiles name (`python:3.11-slim-bookworm`)
  is stood in for by a local image of that exact name: a Debian bookworm minbase made by
  debootstrap, with python3, pip and ca-certificates, imported into podman's storage once per
  machine and labelled as a stand-in. The Dockerfiles stay as users build them.
- crun fails here (cgroups v1); runc works. The default ulimits exceed the machine's hard
  limits, so build and run pass explicit ones; both use the host's network.
- Downloads inside a build go through a TLS-intercepting proxy: the host's CA bundle is
  mounted read-only into the build, never copied into an image.

Everything cached lives outside the checkout: the stand-in and the layers in podman's storage
(an unchanged vLLM layer is reused, which is what makes a warm build cost seconds), buildah's
cache mounts (pip's cache) under `cache_dir()`. That proxy strips the headers pip's HTTP cache
needs, so here pip's cache stays empty and a build without its layers downloads again.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import secrets
import shutil
import subprocess
import tempfile
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[2]
DOCKER = ROOT / "docker"

# The base both CPU Dockerfiles name, as podman resolves the short name.
BASE = "docker.io/library/python:3.11-slim-bookworm"
STANDIN_LABEL = "org.vllm-hotswap.standin"
DEBIAN_MIRROR = "http://deb.debian.org/debian"
STANDIN_PACKAGES = ("python3", "python3-pip", "ca-certificates", "passwd")

PODMAN = ("podman", "--runtime", "runc")
ULIMITS = ("--ulimit", "nofile=1024:1024", "--ulimit", "nproc=4096:4096")
HOST_CA = Path("/etc/ssl/certs/ca-certificates.crt")
# Where a Debian image keeps the bundle that pip (Debian's) and curl read.
IMAGE_CA = "/etc/ssl/certs/ca-certificates.crt"


class ImageError(RuntimeError):
    """A podman step failed or ran past its bound; the message carries the output's tail."""


def cache_dir() -> Path:
    """Outside the checkout, next to the project's venv (scripts/bootstrap.sh's rule)."""
    base = os.environ.get("HOTSWAP_CACHE_DIR") or str(
        Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "vllm-hotswap"
    )
    path = Path(base) / "images"
    path.mkdir(parents=True, exist_ok=True)
    return path


def _tail(text: str, lines: int = 40) -> str:
    return "\n".join(text.splitlines()[-lines:])


def _env() -> dict[str, str]:
    """podman's environment: buildah keeps `RUN --mount=type=cache` folders under TMPDIR, so
    that must outlive this run for pip's wheels to be reused by the next build."""
    env = dict(os.environ)
    tmp = cache_dir() / "tmp"
    tmp.mkdir(exist_ok=True)
    env["TMPDIR"] = str(tmp)
    return env


def podman(
    *args: str, timeout_s: float = 120.0, log: Path | None = None, check: bool = True
) -> subprocess.CompletedProcess[str]:
    """One podman command with a bound; output kept (and appended to `log` when given)."""
    argv = [*PODMAN, *args]
    try:
        proc = subprocess.run(
            argv,
            capture_output=True,
            text=True,
            timeout=timeout_s,
            env=_env(),
            stdin=subprocess.DEVNULL,
        )
    except subprocess.TimeoutExpired as exc:
        out = (exc.stdout or b"").decode(errors="replace") if isinstance(exc.stdout, bytes) else ""
        raise ImageError(f"{' '.join(argv)}: over {timeout_s:.0f} s\n{_tail(out)}") from None
    if log is not None:
        with log.open("a") as f:
            f.write(f"$ {' '.join(argv)}\n{proc.stdout}{proc.stderr}\n")
    if check and proc.returncode != 0:
        raise ImageError(
            f"{' '.join(argv)} exited {proc.returncode}\n{_tail(proc.stdout + proc.stderr)}"
        )
    return proc


def unavailable() -> str | None:
    """Why podman cannot run at all here (then the image tests skip), or None."""
    if shutil.which("podman") is None:
        return "podman is not installed (scripts/system-deps.sh installs podman, runc, debootstrap)"
    if shutil.which("runc") is None and not Path("/usr/sbin/runc").is_file():
        return "runc is not installed (scripts/system-deps.sh installs it)"
    try:
        proc = podman("info", "--format", "{{.Store.GraphRoot}}", timeout_s=60.0, check=False)
    except ImageError as exc:
        return f"podman info does not answer: {exc}"
    if proc.returncode != 0:
        return f"podman cannot run here: {_tail(proc.stderr, 5)}"
    return None


def image_exists(tag: str) -> bool:
    return podman("image", "exists", tag, check=False).returncode == 0


def image_id(tag: str) -> str | None:
    proc = podman("image", "inspect", "--format", "{{.Id}}", tag, check=False)
    return proc.stdout.strip() or None if proc.returncode == 0 else None


def image_size(tag: str) -> int:
    """Bytes of the image as podman stores it (all layers, uncompressed)."""
    return int(podman("image", "inspect", "--format", "{{.Size}}", tag).stdout.strip())


def image_config(tag: str) -> dict[str, object]:
    (info,) = json.loads(podman("image", "inspect", tag).stdout)
    config: dict[str, object] = info.get("Config", {})
    return config


@contextlib.contextmanager
def _locked(name: str) -> Iterator[None]:
    """One builder of a shared thing per machine at a time (tests of two checkouts may race)."""
    with (cache_dir() / f"{name}.lock").open("w") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def ensure_standin_base(log: Path, timeout_s: float = 900.0) -> float:
    """Make BASE exist locally; returns the seconds it took (0.0 when it was already there).

    A real `python:3.11-slim-bookworm` (pulled by a machine that can) is used as it is.
    """
    with _locked("standin"):
        if image_exists(BASE):
            return 0.0
        if shutil.which("debootstrap") is None and not Path("/usr/sbin/debootstrap").is_file():
            raise ImageError("debootstrap is not installed (scripts/system-deps.sh installs it)")
        t0 = time.monotonic()
        with tempfile.TemporaryDirectory(dir=cache_dir(), prefix="rootfs-") as tmp:
            rootfs = Path(tmp) / "rootfs"
            argv = [
                "debootstrap",
                "--variant=minbase",
                f"--include={','.join(STANDIN_PACKAGES)}",
                "bookworm",
                str(rootfs),
                DEBIAN_MIRROR,
            ]
            try:
                proc = subprocess.run(
                    argv,
                    capture_output=True,
                    text=True,
                    timeout=timeout_s,
                    stdin=subprocess.DEVNULL,
                )
            except subprocess.TimeoutExpired:
                raise ImageError(f"debootstrap: over {timeout_s:.0f} s") from None
            with log.open("a") as f:
                f.write(f"$ {' '.join(argv)}\n{proc.stdout}{proc.stderr}\n")
            if proc.returncode != 0:
                raise ImageError(f"debootstrap exited {proc.returncode}\n{_tail(proc.stdout)}")
            # The official image has `python` and `pip` on PATH in /usr/local/bin.
            for name, target in (("python", "/usr/bin/python3"), ("pip", "/usr/bin/pip3")):
                (rootfs / "usr/local/bin" / name).symlink_to(target)
            for junk in ("var/cache/apt/archives", "var/lib/apt/lists"):
                for entry in (rootfs / junk).glob("*"):
                    if entry.is_file():
                        entry.unlink()
            tarball = Path(tmp) / "rootfs.tar"
            subprocess.run(
                ["tar", "-C", str(rootfs), "--numeric-owner", "-cf", str(tarball), "."],
                check=True,
                timeout=300.0,
            )
            podman(
                "import",
                # The official image's Python is its own; Debian's refuses system installs
                # without this (PEP 668), which is what the Dockerfiles do.
                "--change",
                "ENV PIP_BREAK_SYSTEM_PACKAGES=1",
                "--change",
                "ENV PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
                "--change",
                "ENV LANG=C.UTF-8",
                "--change",
                f"LABEL {STANDIN_LABEL}=debootstrap-bookworm-minbase",
                "--change",
                'CMD ["python3"]',
                str(tarball),
                BASE,
                timeout_s=300.0,
                log=log,
            )
        return time.monotonic() - t0


def _find_links() -> list[Path]:
    """Local wheel folders the host's pip searches (PIP_FIND_LINKS): torch's CPU build is not
    on PyPI; where the host keeps it, the build gets it from there (read-only)."""
    found = []
    for item in os.environ.get("PIP_FIND_LINKS", "").split():
        path = Path(item.removeprefix("file://"))
        if path.is_dir():
            found.append(path)
    return found


@dataclass(frozen=True)
class Build:
    tag: str
    seconds: float
    size_bytes: int
    log: Path


def build(
    dockerfile: Path,
    tag: str,
    log: Path,
    *,
    build_args: Mapping[str, str] | None = None,
    volumes: Sequence[str] = (),
    timeout_s: float = 900.0,
) -> Build:
    """`podman build` from the repository root, as the Dockerfile's header says users do."""
    args = [
        "build",
        "--pull=never",  # the base is local (real or stand-in); nothing can be pulled here
        "--layers",
        "--network",
        "host",
        *ULIMITS,
        "-f",
        str(dockerfile),
        "-t",
        tag,
    ]
    if HOST_CA.is_file():
        args += ["-v", f"{HOST_CA}:{IMAGE_CA}:ro"]
    for volume in volumes:
        args += ["-v", volume]
    for key, value in (build_args or {}).items():
        args += ["--build-arg", f"{key}={value}"]
    before = image_id(tag)
    t0 = time.monotonic()
    podman(*args, str(ROOT), timeout_s=timeout_s, log=log)
    seconds = time.monotonic() - t0
    if before is not None and before != image_id(tag):
        # The image this tag named before (and its layers no other image uses): CI builds
        # after every change, and the machine's storage must not grow with each one.
        podman("rmi", before, timeout_s=120.0, log=log, check=False)
    return Build(tag=tag, seconds=seconds, size_bytes=image_size(tag), log=log)


def wheel_mounts() -> tuple[dict[str, str], list[str]]:
    """Build args and read-only volumes that point a build's pip at the host's local wheels."""
    links = _find_links()
    if not links:
        return {}, []
    mounts = [f"{p}:/mnt/find-links/{i}:ro" for i, p in enumerate(links)]
    args = {
        # The PyTorch project's index is then not needed (nor, here, reachable).
        "PIP_EXTRA_INDEX_URL": "",
        "PIP_FIND_LINKS": " ".join(f"/mnt/find-links/{i}" for i in range(len(links))),
    }
    return args, mounts


@dataclass
class Container:
    """One `podman run -d` container: logs, exec, signals, and a removal that always happens."""

    name: str
    log: Path
    started: bool = False
    _exited: int | None = field(default=None, repr=False)

    def logs(self) -> str:
        proc = podman("logs", self.name, timeout_s=60.0, check=False)
        return proc.stdout + proc.stderr

    def logs_tail(self, lines: int = 60) -> str:
        return _tail(self.logs(), lines)

    def exec(self, *argv: str, timeout_s: float = 60.0) -> subprocess.CompletedProcess[str]:
        return podman("exec", self.name, *argv, timeout_s=timeout_s, check=False)

    def inspect(self) -> dict[str, object]:
        (info,) = json.loads(podman("container", "inspect", self.name, timeout_s=60.0).stdout)
        result: dict[str, object] = info
        return result

    def running(self) -> bool:
        proc = podman(
            "container",
            "inspect",
            "--format",
            "{{.State.Running}}",
            self.name,
            timeout_s=60.0,
            check=False,
        )
        return proc.stdout.strip() == "true"

    def signal(self, sig: str) -> None:
        podman("kill", "--signal", sig, self.name, timeout_s=60.0)

    def wait(self, timeout_s: float) -> int:
        """The container's exit code once it stopped; ImageError past the bound."""
        proc = podman("wait", self.name, timeout_s=timeout_s)
        return int(proc.stdout.strip().splitlines()[-1])

    def remove(self) -> None:
        try:
            with contextlib.suppress(OSError, ImageError), self.log.open("a") as f:
                f.write(self.logs())
        finally:
            podman("rm", "--force", "--time", "20", self.name, timeout_s=120.0, check=False)


@contextlib.contextmanager
def container(
    image: str,
    *argv: str,
    log: Path,
    env: Mapping[str, str] | None = None,
    options: Sequence[str] = (),
    entrypoint: str | None = None,
) -> Iterator[Container]:
    """Run `image` detached on the host's network; removed (logs kept in `log`) on exit."""
    name = f"hotswap-test-{os.getpid()}-{secrets.token_hex(3)}"
    args = ["run", "-d", "--name", name, "--network", "host", *ULIMITS, *options]
    for key, value in (env or {}).items():
        args += ["--env", f"{key}={value}"]
    if entrypoint is not None:
        args += ["--entrypoint", entrypoint]
    box = Container(name=name, log=log)
    try:
        podman(*args, image, *argv, timeout_s=120.0, log=log)
        box.started = True
        yield box
    finally:
        box.remove()


# ----------------------------------------------------------------------------- the session's builds


@dataclass(frozen=True)
class BuildRecord:
    what: str
    seconds: float
    size_bytes: int | None


BUILDS = pytest.StashKey[list[BuildRecord]]()


@dataclass
class Images:
    """Builds the project's images (once each per session) and records what they cost."""

    logs: Path
    config: pytest.Config
    built: dict[str, Build]

    def base(self) -> None:
        seconds = ensure_standin_base(self.logs / "standin.log")
        if seconds:
            self.record(f"stand-in {BASE} (debootstrap + import)", seconds, None)

    def build(self, dockerfile: str, tag: str, **kw: Any) -> Build:
        if tag not in self.built:
            self.base()
            log = self.logs / f"{Path(dockerfile).stem}.build.log"
            try:
                done = build(DOCKER / dockerfile, tag, log, **kw)
            except ImageError as exc:
                pytest.fail(f"building {dockerfile} failed (full log: {log}):\n{exc}")
            self.built[tag] = done
            self.record(f"{tag} (docker/{dockerfile})", done.seconds, done.size_bytes)
        return self.built[tag]

    def record(self, what: str, seconds: float, size: int | None) -> None:
        self.config.stash[BUILDS].append(BuildRecord(what, seconds, size))
