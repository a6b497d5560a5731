"""One typed settings object, built once at start-up and passed down: the root `Settings`,
its sources and the sections of how it runs models (timeouts, logs, swap, supervisor) here;
how it is reached (server, auth, gateway) in `controller.config.servesettings`; one model's
(`ModelSettings`, the models file's entries) in `controller.config.modelsettings`; the numeric
bounds in `controller.config.bounds`.

Sources, highest first: CLI flags (the CLI passes them as init kwargs), environment
variables (`HOTSWAP_` prefix, `__` between nested names, e.g. `HOTSWAP_SERVER__PORT=9000`),
the YAML models file, then the defaults below.
"""

from __future__ import annotations

import enum
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, Field, field_validator, model_validator
from pydantic_settings import BaseSettings, PydanticBaseSettingsSource, SettingsConfigDict

from controller.config.bounds import DAY_S, HOUR_S, MAX_BYTES
from controller.config.modelsettings import DeviceId, ModelSettings
from controller.config.modelsettings import resolve as resolve_placement
from controller.config.servesettings import (
    AuthSettings,
    GatewaySettings,
    ServerSettings,
    is_loopback,
)
from controller.state import Gate


class LogFormat(enum.StrEnum):
    TEXT = "text"
    JSON = "json"


class TimeoutSettings(BaseModel):
    """Seconds. Each is an HTTP client timeout: nothing is ever sent as an RPC `timeout`."""

    control_s: float = Field(
        10.0, gt=0, le=HOUR_S, description="/pause (abort), /resume, /is_paused, /health."
    )
    rpc_s: float = Field(
        120.0,
        gt=0,
        le=DAY_S,
        description="One /collective_rpc call; generous: a level-1 suspend copies weights.",
    )
    reload_s: float = Field(
        600.0, gt=0, le=DAY_S, description="hotswap_reload: reads the whole checkpoint."
    )
    quiesce_s: float = Field(
        10.0, gt=0, le=HOUR_S, description="Barrier timeout inside the ranks (sent as an argument)."
    )
    warmup_s: float = Field(
        60.0, gt=0, le=HOUR_S, description="The 1-token warm-up completion after a wake."
    )
    drain_s: float = Field(
        30.0, ge=0, le=HOUR_S, description="Default drain timeout of a sleep with drain=wait."
    )
    probe_s: float = Field(
        5.0, gt=0, le=HOUR_S, description="Start-up probe of an attached engine."
    )
    reprobe_interval_s: float = Field(
        2.0,
        gt=0,
        le=HOUR_S,
        description="How often every attached engine is read back and reconciled, in every "
        "state but a transition in flight (/health, /is_paused, /metrics; hotswap_info only "
        "when those do not match the cache); short against a vLLM restart (tens of seconds).",
    )
    shutdown_s: float = Field(
        30.0, ge=0, le=HOUR_S, description="How long shutdown waits for transitions in flight."
    )
    checkpoint_lock_s: float = Field(
        10.0,
        gt=0,
        le=HOUR_S,
        description="A deep sleep's driver lock: a process inside a CUDA call is waited for "
        "this long, then the sleep stays not deep (the lock's own timeout, never unbounded).",
    )
    checkpoint_s: float = Field(
        300.0,
        gt=0,
        le=DAY_S,
        description="One call of the checkpoint helper (lock, checkpoint or restore of every "
        "process); past it the helper is killed and the model is FAILED (state unknown).",
    )
    stop_drain_s: float = Field(
        30.0,
        ge=0,
        le=HOUR_S,
        description="On SIGTERM: how long the gateway's requests in flight (streams included) "
        "may take to finish while nothing new is admitted (503 + Retry-After), before the "
        "transitions are waited for (shutdown_s) and the engines stopped "
        "(supervisor.stop_grace_s). The pod's terminationGracePeriodSeconds must cover the "
        "three.",
    )


class LogSettings(BaseModel):
    """The sidecar's own log (engine logs go to `supervisor.log_dir`)."""

    format: LogFormat = Field(
        LogFormat.TEXT, description="text for humans, json for log pipelines."
    )
    level: str = Field("INFO", description="Root log level.")
    max_repeats_per_minute: int = Field(
        10,
        ge=1,
        le=100_000,
        description="Lines of one message per minute from the accept loop and uvicorn "
        "(asyncio, uvicorn.error); the rest are dropped and counted in the next line let "
        "through. Out of file descriptors, the accept loop logs an error per try.",
    )
    probe_access: bool = Field(
        False,
        description="Log the probes that succeed (a GET or HEAD of /livez, /health, "
        "/models/{name}/health or /metrics answered below 400) in the access log too; off, "
        "only their failures are (the kubelet's probes and Prometheus' scrapes would be a "
        "line each, every few seconds).",
    )


class SwapSettings(BaseModel):
    """The memory budget and eviction policy (controller.fleet.policy) per device."""

    budget_bytes: int | None = Field(
        None,
        ge=0,
        le=MAX_BYTES,
        description="Bytes the awake models of one device may hold; None = measured at boot "
        "(CUDA: free memory with every model asleep) or no byte limit (CPU).",
    )
    max_awake: int | None = Field(
        None,
        ge=1,
        le=1024,
        description="At most this many awake models per device; None = no count limit.",
    )
    min_awake_s: float = Field(
        2.0,
        ge=0,
        le=HOUR_S,
        description="A model woken less than this long ago is not evicted (no thrash).",
    )
    evict_drain_timeout_s: float = Field(
        30.0,
        ge=0,
        le=HOUR_S,
        description="drain=wait timeout when a model is put to sleep to make room.",
    )
    deepen_wait_s: float = Field(
        3.0,
        ge=0,
        le=HOUR_S,
        description="How long an evicted model's checkpoint after its swap (deep_sleep "
        "always) waits for the wakes on its device to end before it runs beside them.",
    )
    overlap: Literal["auto", "always", "never"] = Field(
        "auto",
        description="Overlap an evicted model's offload with the woken model's load when the "
        "byte budget has room for both models' weights (controller.fleet.swap): auto = only when "
        "the evicted model's last sleep copied its weights off the device (CUDA, level 1; "
        "on CPU or at level 2 nothing is copied and the split sleep only adds a round trip), "
        "always = whenever the budget has room, never = one after the other.",
    )
    devices: list[DeviceId] | None = Field(
        None,
        min_length=1,
        description="The pod's accelerators, as CUDA_VISIBLE_DEVICES names them; managed "
        "models are placed on them (named `devices`, else `tp_size` of the least loaded) and "
        "get CUDA_VISIBLE_DEVICES; budgets, locks and LRU are per device. None = the devices "
        "the models name (`device`, default 0), engines' CUDA_VISIBLE_DEVICES untouched.",
    )
    host_budget: int | float | None = Field(
        None,
        ge=0,
        le=MAX_BYTES,
        description="Host RAM the models may hold (level-1 sleepers' weights, awake models' "
        "kept backups): bytes, or a fraction in (0, 1] of the RAM this container may use (the "
        "machine's, or its cgroup's memory limit where lower). Over it, LRU "
        "level-1 sleepers are demoted to level 2 (their host copy released; CPU, and CUDA "
        "with HOTSWAP_DEMOTABLE on), else the sleep is "
        "made at level 2. None = no host budget.",
    )
    idle_sleep_s: float | None = Field(
        None,
        ge=0,
        le=7 * DAY_S,
        description="Default for every model: put to sleep a model that served nothing (and "
        "was not woken) for this long; woken again by the gateway's next request. None or 0 = "
        "off. Never a pinned model, never with requests in flight or queued.",
    )
    idle_sleep_level: int = Field(
        1, ge=1, le=2, description="Default sleep level of an idle sleep."
    )

    @field_validator("host_budget", mode="before")
    @classmethod
    def _host_budget_text(cls, v: Any) -> Any:
        # From the environment: "0.5" and "1.0" are fractions, "1073741824" bytes.
        if isinstance(v, str):
            text = v.strip()
            try:
                return int(text)
            except ValueError:
                try:
                    return float(text)
                except ValueError:
                    return v
        return v

    @field_validator("host_budget")
    @classmethod
    def _host_budget(cls, v: int | float | None) -> int | float | None:
        if isinstance(v, float) and not 0 < v <= 1:
            raise ValueError(
                "swap.host_budget: a fraction of the machine's RAM must be in (0, 1]; "
                "bytes are a whole number"
            )
        return v


class SupervisorSettings(BaseModel):
    """Managed engines: boot, crash detection, restart with bounded exponential backoff."""

    boot_timeout_s: float = Field(
        300.0, gt=0, le=DAY_S, description="An engine must answer /health by then."
    )
    restart_backoff_s: float = Field(
        1.0, gt=0, le=HOUR_S, description="First restart delay after a crash."
    )
    restart_backoff_max_s: float = Field(
        60.0, gt=0, le=DAY_S, description="Cap of the doubling delay."
    )
    stable_s: float = Field(
        60.0, ge=0, le=DAY_S, description="Up this long after a start: the failure count resets."
    )
    stop_grace_s: float = Field(
        15.0, ge=0, le=HOUR_S, description="SIGTERM grace before SIGKILL at stop."
    )
    engine_nice: int = Field(
        10,
        ge=0,
        le=19,
        description="How many steps below the sidecar's CPU priority the managed engines run "
        "(added to its nice value, inherited by every engine process and thread): when both "
        "want a CPU the sidecar comes first, so its probes and the gateway are not starved "
        "by the engines it manages. A nice value orders only the processes of one CPU cgroup "
        "(the container; outside containers, where the kernel groups by session, the "
        "session: the engines stay in the sidecar's). 0 = the sidecar's priority.",
    )
    log_dir: Path | None = Field(
        None, description="Engine logs (one file per model); None = a temporary folder."
    )
    socket_dir: Path | None = Field(
        None,
        description="Folder of the engines' Unix sockets, kept 0700 (only the sidecar's user "
        "reaches the dev endpoints); None = a new private temporary folder per start.",
    )


class Settings(BaseSettings):
    model_config = SettingsConfigDict(
        env_prefix="HOTSWAP_",
        env_nested_delimiter="__",
        extra="forbid",
        validate_default=True,
        hide_input_in_errors=True,  # a rejected value may be the token
    )

    config_file: Path | None = Field(
        None, description="YAML models file; its values sit below env vars."
    )
    state_dir: Path | None = Field(
        None,
        description="Where the sidecar keeps what must outlive its own restart: the "
        "quarantine of an attached engine whose reply queues may be out of step. In a pod, "
        "an emptyDir (it lives as long as the pod, not the container). None = beside each "
        "attached engine's Unix socket; an engine reached by URL then keeps none.",
    )
    server: ServerSettings = Field(default_factory=ServerSettings)
    auth: AuthSettings = Field(default_factory=AuthSettings)
    timeouts: TimeoutSettings = Field(default_factory=TimeoutSettings)
    log: LogSettings = Field(default_factory=LogSettings)
    gateway: GatewaySettings = Field(default_factory=GatewaySettings)
    swap: SwapSettings = Field(default_factory=SwapSettings)
    supervisor: SupervisorSettings = Field(default_factory=SupervisorSettings)
    models: list[ModelSettings] = Field(default_factory=list)

    @field_validator("models")
    @classmethod
    def _unique_names(cls, v: list[ModelSettings]) -> list[ModelSettings]:
        names = [m.name for m in v]
        dupes = sorted({n for n in names if names.count(n) > 1})
        if dupes:
            raise ValueError(f"duplicate model names: {', '.join(dupes)}")
        return v

    @property
    def managed(self) -> bool:
        """The sidecar starts and supervises (some of) its engines."""
        return any(m.managed for m in self.models)

    @property
    def idle_sleeping(self) -> bool:
        """Some model has idle sleep on (something must wake it: the gateway)."""
        return any(self.idle_sleep(m)[0] is not None for m in self.models)

    @property
    def gateway_enabled(self) -> bool:
        if self.gateway.enabled is not None:
            return self.gateway.enabled
        return self.managed or self.idle_sleeping

    def open_binds(self) -> list[str]:
        """The non-loopback addresses that would answer anyone: those bound without a token
        (the gateway counts when it is served). Empty when `server.insecure` allows them."""
        if self.server.insecure:
            return []
        binds = []
        if self.auth.token is None and not is_loopback(self.server.host):
            binds.append(f"the control API on {self.server.host}:{self.server.port}")
        gateway_open = self.auth.token is None and self.auth.gateway_tokens is None
        if self.gateway_enabled and gateway_open and not is_loopback(self.gateway.host):
            binds.append(f"the gateway on {self.gateway.host}:{self.gateway.port}")
        return binds

    @property
    def hot_swap(self) -> bool:
        """Wakes go through the swap policy (a budget, managed engines or the gateway)."""
        swap = self.swap
        budget = swap.budget_bytes is not None or swap.max_awake is not None
        fleet = swap.host_budget is not None or swap.devices is not None
        return budget or fleet or self.idle_sleeping or self.managed or self.gateway_enabled

    @model_validator(mode="after")
    def _vllm_driven_outside_host_budget(self) -> Settings:
        driven = [m.name for m in self.models if m.sleep_driver == "vllm"]
        if driven and self.swap.host_budget is not None:
            raise ValueError(
                f"models {driven} sleep through vLLM (sleep_driver vllm), whose host copy no "
                "rank reports: swap.host_budget could not count it; unset one of them"
            )
        return self

    @model_validator(mode="after")
    def _placed(self) -> Settings:
        self.models = resolve_placement(self.models, self.swap.devices)
        return self

    def idle_sleep(self, model: ModelSettings) -> tuple[float | None, int]:
        """A model's idle sleep: seconds (None = off) and level."""
        s = model.idle_sleep_s if model.idle_sleep_s is not None else self.swap.idle_sleep_s
        level = model.idle_sleep_level or self.swap.idle_sleep_level
        return (s if s else None), level

    @model_validator(mode="after")
    def _hot_swap_gates(self) -> Settings:
        # Behind the gateway a sleeping model is healthy: it wakes on the next request.
        if self.gateway_enabled:
            self.models = [
                m.model_copy(update={"gate": Gate.SWAPPABLE})
                if (m.managed or self.idle_sleep(m)[0] is not None)
                and "gate" not in m.model_fields_set
                else m
                for m in self.models
            ]
        return self

    @classmethod
    def settings_customise_sources(
        cls,
        settings_cls: type[BaseSettings],
        init_settings: PydanticBaseSettingsSource,
        env_settings: PydanticBaseSettingsSource,
        dotenv_settings: PydanticBaseSettingsSource,
        file_secret_settings: PydanticBaseSettingsSource,
    ) -> tuple[PydanticBaseSettingsSource, ...]:
        return (init_settings, env_settings, _YamlSource(settings_cls, init_settings, env_settings))


class _YamlSource(PydanticBaseSettingsSource):
    """Reads the models file named by `config_file` (init kwarg or HOTSWAP_CONFIG_FILE)."""

    def __init__(
        self,
        settings_cls: type[BaseSettings],
        init: PydanticBaseSettingsSource,
        env: PydanticBaseSettingsSource,
    ) -> None:
        super().__init__(settings_cls)
        self._init = init
        self._env = env

    def get_field_value(self, field: Any, field_name: str) -> tuple[Any, str, bool]:
        return None, field_name, False

    def __call__(self) -> dict[str, Any]:
        path = self._init().get("config_file") or self._env().get("config_file")
        if not path:
            return {}
        data = read_models_file(Path(path))
        if data is None:
            return {}
        if not isinstance(data, dict):
            raise ValueError(f"{path}: the models file must be a mapping")
        return data


def read_models_file(path: Path) -> Any:
    """The models file's YAML; a file that cannot be read or is not YAML is a ValueError of
    one line, `FILE:LINE:COLUMN: what` (the command line prints it and exits 2)."""
    try:
        text = path.read_text()
    except (OSError, UnicodeDecodeError) as exc:
        raise ValueError(f"{path}: {exc}") from None
    try:
        return yaml.safe_load(text)
    except yaml.MarkedYAMLError as exc:
        mark = exc.problem_mark or exc.context_mark
        where = f"{path}:{mark.line + 1}:{mark.column + 1}" if mark is not None else str(path)
        what = " ".join(str(x) for x in (exc.context, exc.problem) if x)
        raise ValueError(f"{where}: {what or 'not YAML'}") from None
    except yaml.YAMLError as exc:
        raise ValueError(f"{path}: {' '.join(str(exc).split())}") from None


def load_settings(**overrides: Any) -> Settings:
    """Build the settings; `overrides` are CLI values (None values are dropped)."""
    return Settings(**{k: v for k, v in overrides.items() if v is not None})
