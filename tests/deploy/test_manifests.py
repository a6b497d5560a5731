"""deploy/k8s as rendered by `kubectl kustomize`: every document validates against the
Kubernetes schemas (kubernetes-validate, offline, strict), the ServiceMonitor against the CRD
schema kept in deploy/crds; and the properties the product relies on hold in every variant."""

from __future__ import annotations

import copy
import re
from pathlib import Path
from typing import Any

import jsonschema
import kubernetes_validate
import pytest
import yaml
from deploytools import K8S, SERVICEMONITOR_CRD, kustomize_dirs, labels_match, one, render

from controller.cli import build_parser
from controller.config.settings import Settings

# The Kubernetes version the manifests are checked against.
K8S_VERSION = "1.30.0"
CONTROL_PORT = 8800
GATEWAY_PORT = 8801
ENGINE_SOCKET = "/run/hotswap/engine.sock"
EXTENSION = "worker_ext.HotSwapExtension"

VARIANTS = {p.relative_to(K8S).as_posix(): p for p in kustomize_dirs()}


@pytest.fixture(scope="module", params=sorted(VARIANTS))
def variant(request: pytest.FixtureRequest) -> tuple[str, list[dict[str, Any]]]:
    name: str = request.param
    return name, render(VARIANTS[name])


def test_every_variant_is_found() -> None:
    assert {"base", "overlays/managed", "overlays/tp2", "overlays/multigpu-managed"} <= set(
        VARIANTS
    )


# ----------------------------------------------------------------------------- schemas


def _strict(schema: Any) -> Any:
    """Reject fields the schema does not name, like a strict API server (metadata excepted)."""
    if isinstance(schema, dict):
        out = {k: _strict(v) for k, v in schema.items()}
        if "properties" in schema and "additionalProperties" not in schema:
            out["additionalProperties"] = False
        return out
    if isinstance(schema, list):
        return [_strict(v) for v in schema]
    return schema


def _crd_schema(crd: dict[str, Any], version: str) -> dict[str, Any]:
    served = {v["name"]: v for v in crd["spec"]["versions"]}
    schema = copy.deepcopy(served[version]["schema"]["openAPIV3Schema"])
    schema = _strict(schema)
    schema["properties"]["metadata"] = {"type": "object"}
    schema["properties"]["apiVersion"] = {"const": f"{crd['spec']['group']}/{version}"}
    schema["properties"]["kind"] = {"const": crd["spec"]["names"]["kind"]}
    return dict(schema)


CUSTOM = {
    ("monitoring.coreos.com/v1", "ServiceMonitor"): _crd_schema(
        yaml.safe_load(SERVICEMONITOR_CRD.read_text()), "v1"
    ),
}


def validate(doc: dict[str, Any]) -> None:
    key = (doc["apiVersion"], doc["kind"])
    if key in CUSTOM:
        jsonschema.validate(doc, CUSTOM[key])
    else:
        kubernetes_validate.validate(doc, K8S_VERSION, strict=True)


def test_every_document_validates(variant: tuple[str, list[dict[str, Any]]]) -> None:
    name, docs = variant
    assert docs, f"{name} rendered nothing"
    for doc in docs:
        try:
            validate(doc)
        except (kubernetes_validate.ValidationError, jsonschema.ValidationError) as exc:
            pytest.fail(f"{name}: {doc['kind']}/{doc['metadata']['name']}: {exc}")


def test_the_servicemonitor_crd_subset_is_a_valid_crd() -> None:
    kubernetes_validate.validate(
        yaml.safe_load(SERVICEMONITOR_CRD.read_text()), K8S_VERSION, strict=True
    )


@pytest.mark.parametrize(
    ("path", "value"),
    [
        (("spec", "endpoints", 0, "prot"), "control"),  # a typo'd field
        (("spec", "endpoints", 0, "scheme"), "tcp"),  # not in the enum
        (("spec", "endpoints", 0, "interval"), "15 seconds"),  # not a duration
        (("spec", "selector"), None),  # required
    ],
)
def test_the_servicemonitor_schema_rejects_mistakes(path: tuple[Any, ...], value: Any) -> None:
    doc = copy.deepcopy(one(render(K8S / "base"), "ServiceMonitor"))
    validate(doc)
    target: Any = doc
    for key in path[:-1]:
        target = target[key]
    if value is None:
        del target[path[-1]]
    else:
        target[path[-1]] = value
    with pytest.raises(jsonschema.ValidationError):
        validate(doc)


def _service(docs: list[dict[str, Any]], name: str) -> dict[str, Any]:
    found = [d for d in docs if d["kind"] == "Service" and d["metadata"]["name"] == name]
    assert len(found) == 1, f"expected one Service {name}, found {len(found)}"
    return found[0]


def test_kubernetes_validation_is_strict() -> None:
    service = copy.deepcopy(_service(render(K8S / "base"), "vllm-hotswap"))
    service["spec"]["ports"][0]["targetport"] = "control"
    with pytest.raises(kubernetes_validate.ValidationError):
        validate(service)


# ----------------------------------------------------------------------------- pod shape


def _pod(docs: list[dict[str, Any]]) -> dict[str, Any]:
    spec: dict[str, Any] = one(docs, "Deployment")["spec"]["template"]
    return spec


def _models_file(docs: list[dict[str, Any]], pod: dict[str, Any], path: str) -> dict[str, Any]:
    """The models file a container reads at `path`, from the ConfigMap mounted there."""
    mount_dir, _, key = path.rpartition("/")
    for container in pod["spec"]["containers"]:
        for mount in container.get("volumeMounts", []):
            if mount["mountPath"] == mount_dir:
                volume = next(v for v in pod["spec"]["volumes"] if v["name"] == mount["name"])
                cm_name = volume["configMap"]["name"]
                cm = next(
                    d for d in docs if d["kind"] == "ConfigMap" and d["metadata"]["name"] == cm_name
                )
                data: dict[str, Any] = yaml.safe_load(cm["data"][key])
                return data
    raise AssertionError(f"nothing is mounted at {mount_dir}")


def _controller(pod: dict[str, Any]) -> dict[str, Any]:
    """The container that runs `hotswap serve` (sidecar or managed)."""
    found = [
        c
        for c in pod["spec"]["containers"]
        if "serve" in c.get("args", []) and c.get("command", ["hotswap"])[0] == "hotswap"
    ]
    assert len(found) == 1, [c["name"] for c in pod["spec"]["containers"]]
    return found[0]


def _flag(argv: list[str], flag: str) -> str | None:
    """The value of `--flag=value` or `--flag value`; '' for a bare flag; None when absent."""
    for i, arg in enumerate(argv):
        if arg == flag:
            nxt = argv[i + 1] if i + 1 < len(argv) else ""
            return "" if nxt.startswith("--") else nxt
        if arg.startswith(flag + "="):
            return arg.split("=", 1)[1]
    return None


def _engine_argvs(
    docs: list[dict[str, Any]], pod: dict[str, Any]
) -> list[tuple[list[str], dict[str, str]]]:
    """Every vLLM server argv with its env: containers that run it, and managed models."""
    out = []
    for c in pod["spec"]["containers"]:
        argv = [*c.get("command", []), *c.get("args", [])]
        if "vllm.entrypoints.openai.api_server" in argv or argv[:2] == ["vllm", "serve"]:
            env = {e["name"]: e.get("value", "") for e in c.get("env", [])}
            out.append((argv, env))
    config = _flag(_controller(pod)["args"], "--config")
    if config:
        for model in _models_file(docs, pod, config).get("models", []):
            if model.get("command"):
                out.append((model["command"], model.get("env", {})))
    return out


def test_vllm_runs_with_sleep_mode_and_the_extension_on_loopback_only(
    variant: tuple[str, list[dict[str, Any]]],
) -> None:
    name, docs = variant
    engines = _engine_argvs(docs, _pod(docs))
    assert engines, f"{name}: no vLLM server found"
    for argv, env in engines:
        # No TCP port: a socket in a volume of the pod (attached) or in the controller's
        # private folder, which the controller adds itself (managed).
        assert _flag(argv, "--host") is None, argv
        assert _flag(argv, "--port") is None, argv
        assert (_flag(argv, "--uds") == ENGINE_SOCKET) is name.startswith(("base", "overlays/tp2"))
        assert _flag(argv, "--enable-sleep-mode") == "", argv
        assert _flag(argv, "--worker-extension-cls") == EXTENSION, argv
        assert env.get("VLLM_SERVER_DEV_MODE") == "1", argv


def test_the_models_file_is_valid_settings(
    variant: tuple[str, list[dict[str, Any]]], tmp_path: Path
) -> None:
    name, docs = variant
    pod = _pod(docs)
    controller = _controller(pod)
    config = _flag(controller["args"], "--config")
    assert config, f"{name}: the controller reads no models file"
    path = tmp_path / "models.yaml"
    path.write_text(yaml.safe_dump(_models_file(docs, pod, config)))
    settings = Settings(config_file=path)
    assert settings.models, f"{name}: the models file names no model"
    managed = any(m.command for m in settings.models)
    for model in settings.models:
        if model.command:
            # The controller places the socket itself, in its private folder.
            assert model.uds is None, model.name
            assert _flag(model.command, "--served-model-name") == model.served_model_name
        else:
            # The controller reaches the engine where the engine was told to listen.
            assert model.uds == ENGINE_SOCKET, model.name
        # Managed pods stay ready while models sleep; attached pods gate readiness strictly.
        assert model.gate.value == ("swappable" if managed else "gated"), model.name
    assert managed == name.endswith("managed")
    # vLLM listens on loopback only: inference reaches the pod through the gateway alone.
    assert settings.gateway_enabled, f"{name}: the gateway is off"


def test_the_controller_command_line_parses(variant: tuple[str, list[dict[str, Any]]]) -> None:
    controller = _controller(_pod(variant[1]))
    args = build_parser().parse_args(controller["args"])
    assert args.command == "serve"


def test_probes_point_at_the_sidecar(variant: tuple[str, list[dict[str, Any]]]) -> None:
    pod = _pod(variant[1])
    controller = _controller(pod)
    ports = {p["name"]: p["containerPort"] for p in controller["ports"]}
    assert ports == {"control": CONTROL_PORT, "gateway": GATEWAY_PORT}
    env = {e["name"]: e for e in controller["env"]}
    assert env["HOTSWAP_SERVER__PORT"]["value"] == str(CONTROL_PORT)
    assert env["HOTSWAP_SERVER__HOST"]["value"] == "0.0.0.0"  # the kubelet probes the pod IP
    assert env["HOTSWAP_GATEWAY__HOST"]["value"] == "0.0.0.0"  # the Service reaches the pod IP
    assert env["HOTSWAP_GATEWAY__PORT"]["value"] == str(GATEWAY_PORT)
    for probe, path in (("readinessProbe", "/health"), ("livenessProbe", "/livez")):
        get = controller[probe]["httpGet"]
        assert (get["path"], ports.get(get["port"], get["port"])) == (path, CONTROL_PORT), probe
    assert "startupProbe" in controller


def test_model_load_has_a_startup_budget(variant: tuple[str, list[dict[str, Any]]]) -> None:
    """Attached: vLLM's own container waits out the model load (startup probe sized for it),
    and the sidecar starts only once vLLM answers (postStart hook)."""
    name, docs = variant
    pod = _pod(docs)
    for c in pod["spec"]["containers"]:
        argv = [*c.get("command", []), *c.get("args", [])]
        if "vllm.entrypoints.openai.api_server" not in argv:
            continue
        probe = c["startupProbe"]
        budget_s = probe["periodSeconds"] * probe["failureThreshold"]
        # Minutes, not seconds: a 7B checkpoint alone takes minutes to download and load.
        assert budget_s >= 20 * 60, f"{name}: {c['name']} startup budget {budget_s} s"
        assert ENGINE_SOCKET in " ".join(probe["exec"]["command"])
        hook = " ".join(c["lifecycle"]["postStart"]["exec"]["command"])
        assert ENGINE_SOCKET in hook
        names = [x["name"] for x in pod["spec"]["containers"]]
        assert names.index(c["name"]) < names.index(_controller(pod)["name"])


def test_the_token_comes_from_a_secret_file(variant: tuple[str, list[dict[str, Any]]]) -> None:
    """A mounted Secret, not an environment variable: nothing the controller starts (vLLM in
    managed mode) inherits it, and no container of the pod carries it in its environment."""
    pod = _pod(variant[1])
    controller = _controller(pod)
    env = {e["name"]: e for e in controller["env"]}
    keys = []
    for variable in ("HOTSWAP_AUTH__TOKEN_FILE", "HOTSWAP_AUTH__GATEWAY_TOKEN_FILE"):
        path = env[variable]["value"]
        mount_dir, _, key = path.rpartition("/")
        (mount,) = [m for m in controller["volumeMounts"] if m["mountPath"] == mount_dir]
        assert mount["readOnly"] is True
        (volume,) = [v for v in pod["spec"]["volumes"] if v["name"] == mount["name"]]
        assert volume["secret"]["secretName"]
        keys.append(key)
    # Two keys: the gateway's tokens never open the control API (issue 28 item 4).
    assert [i["path"] for i in volume["secret"]["items"]] == keys
    assert keys[0] != keys[1]
    for c in pod["spec"]["containers"]:
        names = {e["name"] for e in c.get("env", [])}
        assert "HOTSWAP_AUTH__TOKEN" not in names, c["name"]
        assert "HOTSWAP_AUTH__GATEWAY_TOKENS" not in names, c["name"]
        assert not any("secretKeyRef" in e.get("valueFrom", {}) for e in c.get("env", []))


# The worker extension's own settings (worker_ext/settings.py) are meant for the engines.
WORKER_VARS = set(
    re.findall(
        r"HOTSWAP_[A-Z_]+", (Path(__file__).parents[2] / "worker_ext/settings.py").read_text()
    )
)


def test_engines_get_no_hotswap_variables(variant: tuple[str, list[dict[str, Any]]]) -> None:
    """None of the controller's variables (a token among them) reach an engine; the worker
    extension's settings may."""
    name, docs = variant
    for argv, env in _engine_argvs(docs, _pod(docs)):
        theirs = [k for k in env if k.startswith("HOTSWAP_") and k not in WORKER_VARS]
        assert not theirs, (name, argv[:3], theirs)
    assert "HOTSWAP_DISK_DIR" in WORKER_VARS
    assert not [v for v in WORKER_VARS if "__" in v]  # no controller-style nested name


def test_every_container_is_hardened(variant: tuple[str, list[dict[str, Any]]]) -> None:
    """The `restricted` Pod Security Standard and then some: non-root, no privilege
    escalation, no capabilities, RuntimeDefault seccomp, read-only root filesystem."""
    name, docs = variant
    pod = _pod(docs)["spec"]
    assert pod["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}
    assert pod["securityContext"]["runAsNonRoot"] is True
    assert pod["automountServiceAccountToken"] is False
    for c in pod["containers"]:
        sc = c["securityContext"]
        where = f"{name}: {c['name']}"
        assert sc["runAsNonRoot"] is True, where
        assert sc["runAsUser"] >= 10000, where
        assert sc["allowPrivilegeEscalation"] is False, where
        assert sc["capabilities"]["drop"] == ["ALL"], where
        assert "add" not in sc["capabilities"], where
        assert sc["seccompProfile"] == {"type": "RuntimeDefault"}, where
        assert sc["readOnlyRootFilesystem"] is True, where
        assert not sc.get("privileged", False), where


def test_gpus_are_requested(variant: tuple[str, list[dict[str, Any]]]) -> None:
    name, docs = variant
    pod = _pod(docs)
    gpu_containers = [
        c
        for c in pod["spec"]["containers"]
        if "nvidia.com/gpu" in c.get("resources", {}).get("requests", {})
    ]
    assert gpu_containers, f"{name}: no container requests nvidia.com/gpu"
    for c in pod["spec"]["containers"]:
        res = c["resources"]
        assert {"cpu", "memory"} <= set(res["requests"]), c["name"]
        # Extended resources cannot be overcommitted: limits must equal requests.
        if "nvidia.com/gpu" in res["requests"]:
            assert res["limits"]["nvidia.com/gpu"] == res["requests"]["nvidia.com/gpu"]
    if name.endswith("tp2"):
        argv = _engine_argvs(docs, pod)[0][0]
        gpus = gpu_containers[0]["resources"]["requests"]["nvidia.com/gpu"]
        assert _flag(argv, "--tensor-parallel-size") == gpus == "2"


def test_the_multigpu_pod_places_every_engine_on_its_own_gpus(tmp_path: Path) -> None:
    """The multi-GPU managed variant: swap.devices are the pod's GPUs (as many as it
    requests), every engine gets CUDA_VISIBLE_DEVICES for its placement (a TP model as many
    as its size), and every GPU carries some model."""
    docs = render(VARIANTS["overlays/multigpu-managed"])
    pod = _pod(docs)
    controller = _controller(pod)
    path = tmp_path / "models.yaml"
    path.write_text(yaml.safe_dump(_models_file(docs, pod, _flag(controller["args"], "--config"))))
    settings = Settings(config_file=path)
    gpus = int(controller["resources"]["requests"]["nvidia.com/gpu"])
    assert settings.swap.devices == [str(i) for i in range(gpus)]
    used: set[str] = set()
    for m in settings.models:
        visible = m.env["CUDA_VISIBLE_DEVICES"].split(",")
        assert visible == list(m.placement), m.name
        assert m.command is not None
        tp = _flag(m.command, "--tensor-parallel-size") or "1"
        assert len(visible) == int(tp), m.name
        used.update(visible)
    assert used == set(settings.swap.devices)
    assert settings.swap.idle_sleep_s
    assert settings.swap.host_budget == 0.5


def test_images_are_tagged(variant: tuple[str, list[dict[str, Any]]]) -> None:
    for c in _pod(variant[1])["spec"]["containers"]:
        image = c["image"]
        tag = image.rsplit(":", 1)[1] if ":" in image.rsplit("/", 1)[-1] else ""
        assert tag not in ("", "latest"), f"{c['name']}: {image}"


# ----------------------------------------------------------------------------- networking


GATEWAY_SERVICE = "vllm-hotswap"
CONTROL_SERVICE = "vllm-hotswap-control"


def _targets(service: dict[str, Any], pod: dict[str, Any]) -> dict[int, int]:
    named = {
        p["name"]: p["containerPort"] for c in pod["spec"]["containers"] for p in c.get("ports", [])
    }
    assert set(named.values()) == {CONTROL_PORT, GATEWAY_PORT}  # the sidecar's, nothing else
    targets = {}
    for port in service["spec"]["ports"]:
        target = port["targetPort"]
        targets[port["port"]] = named[target] if isinstance(target, str) else target
    return targets


def test_the_services_expose_only_the_sidecar(variant: tuple[str, list[dict[str, Any]]]) -> None:
    """The gateway's Service follows readiness; the control port has its own that does not,
    so a gated pod whose model sleeps (unready by design) can still be woken and scraped."""
    docs = variant[1]
    pod = _pod(docs)
    services = [d for d in docs if d["kind"] == "Service"]
    assert sorted(d["metadata"]["name"] for d in services) == [GATEWAY_SERVICE, CONTROL_SERVICE]
    for service in services:
        assert labels_match({"matchLabels": service["spec"]["selector"]}, pod["metadata"]["labels"])
    gateway, control = _service(docs, GATEWAY_SERVICE), _service(docs, CONTROL_SERVICE)
    assert _targets(gateway, pod) == {GATEWAY_PORT: GATEWAY_PORT}
    assert not gateway["spec"].get("publishNotReadyAddresses", False)
    assert _targets(control, pod) == {CONTROL_PORT: CONTROL_PORT}
    assert control["spec"]["publishNotReadyAddresses"] is True


def test_the_servicemonitor_scrapes_the_control_port(
    variant: tuple[str, list[dict[str, Any]]],
) -> None:
    docs = variant[1]
    monitor = one(docs, "ServiceMonitor")
    matched = [
        d
        for d in docs
        if d["kind"] == "Service"
        and labels_match(monitor["spec"]["selector"], d["metadata"]["labels"])
    ]
    assert [d["metadata"]["name"] for d in matched] == [CONTROL_SERVICE]
    ports = {p["name"]: p["port"] for p in matched[0]["spec"]["ports"]}
    (endpoint,) = monitor["spec"]["endpoints"]
    assert ports[endpoint["port"]] == CONTROL_PORT
    assert endpoint["path"] == "/metrics"


def test_the_networkpolicy_admits_only_the_sidecar_ports(
    variant: tuple[str, list[dict[str, Any]]],
) -> None:
    docs = variant[1]
    policy = one(docs, "NetworkPolicy")
    assert labels_match(policy["spec"]["podSelector"], _pod(docs)["metadata"]["labels"])
    assert "Ingress" in policy["spec"]["policyTypes"]
    admitted = {p["port"] for rule in policy["spec"]["ingress"] for p in rule["ports"]}
    assert admitted == {CONTROL_PORT, GATEWAY_PORT}
    # The control port (sleep, wake) is not open to every pod of the namespace.
    for rule in policy["spec"]["ingress"]:
        if CONTROL_PORT in {p["port"] for p in rule["ports"]}:
            assert {"podSelector": {}} not in rule["from"], rule
            for peer in rule["from"]:
                if "podSelector" in peer:
                    selector = peer["podSelector"]
                    assert not labels_match(selector, {}), selector
                    assert labels_match(selector, {"vllm-hotswap/control": "true"}), selector
    # Prometheus (another namespace) can reach the metrics.
    assert any(
        CONTROL_PORT in {p["port"] for p in rule["ports"]}
        and any("namespaceSelector" in peer for peer in rule["from"])
        for rule in policy["spec"]["ingress"]
    )


def test_the_pdb_covers_the_pods_and_allows_drains(
    variant: tuple[str, list[dict[str, Any]]],
) -> None:
    docs = variant[1]
    pdb = one(docs, "PodDisruptionBudget")
    deployment = one(docs, "Deployment")
    assert labels_match(pdb["spec"]["selector"], _pod(docs)["metadata"]["labels"])
    replicas = deployment["spec"].get("replicas", 1)
    if "maxUnavailable" in pdb["spec"]:
        assert int(pdb["spec"]["maxUnavailable"]) >= 1
    else:
        # A minAvailable equal to the replicas would block every node drain.
        assert int(pdb["spec"]["minAvailable"]) < replicas


def test_the_engine_socket_is_shared_by_vllm_and_the_sidecar_only(
    variant: tuple[str, list[dict[str, Any]]],
) -> None:
    """Attached pods: vLLM's socket lives in a memory emptyDir that exactly the vllm and the
    sidecar containers mount; the pod's fsGroup owns it and vLLM's umask keeps the socket to
    that group, which the sidecar runs as."""
    name, docs = variant
    pod = _pod(docs)
    if name.endswith("managed"):
        return  # one container: its engines' sockets are in the controller's private folder
    folder = ENGINE_SOCKET.rsplit("/", 1)[0]
    mounting = {
        c["name"]: m["name"]
        for c in pod["spec"]["containers"]
        for m in c.get("volumeMounts", [])
        if m["mountPath"] == folder
    }
    assert set(mounting) == {"vllm", _controller(pod)["name"]}
    volume = next(v for v in pod["spec"]["volumes"] if v["name"] in mounting.values())
    assert volume["emptyDir"]["medium"] == "Memory"
    group = pod["spec"]["securityContext"]["fsGroup"]
    assert _controller(pod)["securityContext"]["runAsGroup"] == group
    vllm = next(c for c in pod["spec"]["containers"] if c["name"] == "vllm")
    assert "umask 0007" in " ".join(vllm["command"])


def test_no_manifest_names_a_vllm_port() -> None:
    """vLLM has no TCP listener in any variant: no 8000, no loopback URL, no --port."""
    for path in K8S.rglob("*.yaml"):
        for n, text in enumerate(path.read_text().splitlines(), 1):
            line = text.split("#", 1)[0]  # comments may talk about it
            where = f"{path.relative_to(K8S)}:{n}: {line.strip()}"
            assert not re.search(r"\b8000\b|127\.0\.0\.1|--port\b|--host\b", line), where


def _env_seconds(container: dict[str, Any], name: str, default: float) -> float:
    env = {e["name"]: e.get("value") for e in container.get("env", [])}
    return float(env.get(name, default))


def _pre_stop_s(container: dict[str, Any]) -> float:
    return float(
        container.get("lifecycle", {}).get("preStop", {}).get("sleep", {}).get("seconds", 0)
    )


def test_a_shutdown_has_the_time_to_drain(variant: tuple[str, list[dict[str, Any]]]) -> None:
    """On SIGTERM the sidecar stops admitting, gives the requests in flight
    `timeouts.stop_drain_s`, waits for transitions (`timeouts.shutdown_s`) and, managed,
    stops its engines (`supervisor.stop_grace_s`): the pod's grace covers all of it, after a
    preStop pause that lets the endpoints drop the pod first. An attached vLLM container
    outlives the drain (its own preStop is longer), so no stream in flight loses its engine."""
    name, docs = variant
    pod = _pod(docs)
    controller = _controller(pod)
    defaults = Settings(models=[])
    drain = _env_seconds(
        controller, "HOTSWAP_TIMEOUTS__STOP_DRAIN_S", defaults.timeouts.stop_drain_s
    )
    shutdown = _env_seconds(
        controller, "HOTSWAP_TIMEOUTS__SHUTDOWN_S", defaults.timeouts.shutdown_s
    )
    stop = _env_seconds(
        controller, "HOTSWAP_SUPERVISOR__STOP_GRACE_S", defaults.supervisor.stop_grace_s
    )
    pause = _pre_stop_s(controller)
    assert pause >= 5, f"{name}: the sidecar has no preStop pause"
    need = pause + drain + shutdown + stop + 5  # the keeper's SIGKILL round after its grace
    grace = pod["spec"]["terminationGracePeriodSeconds"]
    assert grace >= need, f"{name}: terminationGracePeriodSeconds {grace} < {need}"
    for c in pod["spec"]["containers"]:
        if c is not controller:
            assert _pre_stop_s(c) >= pause + drain, f"{name}: {c['name']} stops before the drain"


def test_the_sidecars_probes_cover_its_start_not_its_reconciliation(
    variant: tuple[str, list[dict[str, Any]]],
) -> None:
    """The control port binds before any engine is probed (docs/kubernetes.md): the
    startupProbe covers the process's own start (60 s for seconds of imports on a loaded
    node), /livez never waits for an engine, and the start-up reconciliation shows on
    readiness only, which restarts nothing."""
    name, docs = variant
    controller = _controller(_pod(docs))
    start = controller["startupProbe"]
    assert start["httpGet"]["path"] == "/livez", name
    assert start["periodSeconds"] * start["failureThreshold"] >= 60, name
    live = controller["livenessProbe"]
    assert live["periodSeconds"] * live["failureThreshold"] >= 30, name
    assert controller["readinessProbe"]["httpGet"]["path"] == "/health", name
