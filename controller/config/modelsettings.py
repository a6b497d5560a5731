"""One model's settings: an entry of the models file (`Settings.models`).

An engine the sidecar knows by name: attached (someone else runs it at `url` or on `uds`),
or managed (its `command` is the argv the supervisor starts, on a socket of its own).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Annotated, Any, Literal
from urllib.parse import urlsplit

from pydantic import BaseModel, Field, StringConstraints, field_validator, model_validator

from controller.config.bounds import DAY_S, MAX_BYTES
from controller.config.placement import Want, place
from controller.state import Gate

# A device as CUDA_VISIBLE_DEVICES names it: an index, or a GPU-/MIG- UUID.
DeviceId = Annotated[str, StringConstraints(pattern=r"^[A-Za-z0-9][A-Za-z0-9_-]{0,63}$")]


def flag_value(argv: Sequence[str], flag: str) -> str | None:
    """The value of `flag` in argv, given as `--flag VALUE` or `--flag=VALUE`; "" when the
    flag ends argv without a value; None when absent."""
    for i, arg in enumerate(argv):
        if arg == flag:
            return argv[i + 1] if i + 1 < len(argv) else ""
        if arg.startswith(flag + "="):
            return arg[len(flag) + 1 :]
    return None


class ModelSettings(BaseModel):
    """One vLLM OpenAI server the sidecar knows by name."""

    name: str = Field(
        pattern=r"^[A-Za-z0-9][A-Za-z0-9._-]{0,62}$",
        description="The model's name in the API's paths and the gateway's `model` field "
        "(letters, digits, `.`, `_`, `-`; at most 63).",
    )
    url: str = Field(
        description="Base URL of the engine, e.g. http://127.0.0.1:8001 (dev endpoints on); "
        "with `uds` (and for managed engines) http://NAME, whose host only names it in logs.",
    )
    uds: str | None = Field(
        None,
        description="The engine's Unix socket (vLLM's --uds), reached instead of url's host "
        "and port; managed engines get one in supervisor.socket_dir.",
    )
    gate: Gate = Field(Gate.GATED, description="How this model counts toward /health.")
    default_level: int = Field(1, ge=1, le=2, description="Sleep level when a request names none.")
    served_model_name: str | None = Field(
        None, description="The `model` field for the warm-up completion; None: ask /v1/models."
    )
    # Managed mode (the sidecar starts the engine itself); None = attached.
    command: list[str] | None = Field(
        None, description="argv of the engine, when the sidecar starts it."
    )
    env: dict[str, str] = Field(
        default_factory=dict, description="Extra environment of the engine."
    )
    pinned: bool = Field(False, description="Never put to sleep to make room for another model.")
    footprint_bytes: int | None = Field(
        None,
        ge=0,
        le=MAX_BYTES,
        description="Awake footprint if known; None = measured from the engine.",
    )
    device: DeviceId = Field("0", description="Models on one device share its memory budget.")
    devices: list[DeviceId] | None = Field(
        None,
        min_length=1,
        description="The devices of its engine (tensor parallel: one per rank); None = "
        "`device`, or (managed, with swap.devices) `tp_size` devices assigned at start. "
        "/models shows the placement.",
    )
    tp_size: int | None = Field(
        None,
        ge=1,
        le=64,
        description="Devices its engine needs when they are assigned; None = the command's "
        "--tensor-parallel-size, else 1.",
    )
    idle_sleep_s: float | None = Field(
        None,
        ge=0,
        le=7 * DAY_S,
        description="Idle sleep of this model (0 = never); None = swap.idle_sleep_s.",
    )
    idle_sleep_level: int | None = Field(
        None, ge=1, le=2, description="Its idle sleep's level; None = swap.idle_sleep_level."
    )
    keep_prefix_cache: bool = Field(
        False,
        description="Level-1 sleeps keep the KV cache (offloaded to pinned host memory, as big "
        "as the KV pool), so vLLM's prefix cache still hits after the wake; a sleep request's "
        "`keep_prefix_cache` overrides it. Default off: it costs the KV pool's host RAM and "
        "its copy time at sleep and wake.",
    )

    fused_wake: bool = Field(
        True,
        description="A wake's last resume and its verify are one RPC (hotswap_wake): a "
        "level-1 wake is one round trip. False: resume_weights, resume_kv_cache and "
        "restore_and_verify as three RPCs (an extension without hotswap_wake).",
    )

    fused_sleep: bool = Field(
        True,
        description="A level-1 sleep's prepare and suspend are one RPC (hotswap_sleep; on "
        "CUDA the prepare runs under the weights' copies), unless the sleep keeps the KV cache "
        "or is split by pool for an overlapped swap. False: hotswap_prepare then "
        "hotswap_suspend (an extension without hotswap_sleep).",
    )
    deep_sleep: Literal["off", "pressure", "always"] = Field(
        "off",
        description="The driver's process checkpoint after a sleep (docs/contracts.md §2.2): "
        "off (only a sleep that asks `deep: true`), pressure (the swap policy may take it "
        "deep before it evicts an awake model), always (every sleep of it is deep). Off by "
        "default: a checkpointed sleeper holds what the GPU held in host RAM instead.",
    )
    sleep_driver: Literal["extension", "vllm"] = Field(
        "extension",
        description="How the sidecar puts the engine to sleep and wakes it "
        "(docs/contracts.md §2.3): extension (the hotswap_* RPCs, verified by the sidecar) or "
        "vllm (vLLM's own /sleep and /wake_up, for engines with the hotswap sleep-mode backend, "
        "--worker-cls worker_ext.HotSwapWorker, whose wake is verified inside the engine; a "
        "plain vLLM engine only with accept_unverified_wake).",
    )
    accept_unverified_wake: bool = Field(
        False,
        description="With sleep_driver vllm only: serve the engine after a wake that nothing "
        "verified (plain vLLM, its cumem backend), reported as verified: false, "
        "unverified_wake: true, with a WARNING per wake. Off: such a sleep is FAILED.",
    )

    @model_validator(mode="before")
    @classmethod
    def _socket_url(cls, data: Any) -> Any:
        if not isinstance(data, dict):
            return data
        if data.get("command") and data.get("port") is not None:
            raise ValueError(
                "a managed engine listens on a Unix socket the sidecar creates, not on a port: "
                "remove `port`"
            )
        # On a socket the URL's host only names the model in logs and errors (vLLM ignores it).
        named = f"http://{data.get('name', 'engine')}"
        if data.get("command") and data.get("url") not in (None, named):
            raise ValueError("a managed engine has no url: the sidecar reaches it on its socket")
        if (data.get("command") or data.get("uds")) and not data.get("url"):
            return {**data, "url": named}
        return data

    @field_validator("url")
    @classmethod
    def _http_url(cls, v: str) -> str:
        """Only http(s) with a host: the engine client would fail on anything else at the
        first request, long after start; a socket is `uds`."""
        parts = urlsplit(v)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ValueError(
                f"url {v!r}: must be http://HOST[:PORT] or https://HOST[:PORT] "
                "(an engine on a Unix socket is `uds: PATH`)"
            )
        return v.rstrip("/")

    @model_validator(mode="after")
    def _managed_on_its_socket(self) -> ModelSettings:
        if self.command is None:
            return self
        if not self.command:
            raise ValueError("command must not be empty")
        for flag in ("--host", "--port", "--uds"):
            if flag_value(self.command, flag) is not None:
                raise ValueError(
                    f"a managed engine's command must not set {flag}: the sidecar serves it on "
                    "a Unix socket in its private folder (dev endpoints stay unreachable)"
                )
        return self

    @model_validator(mode="after")
    def _kv_kept_at_level_1(self) -> ModelSettings:
        if self.keep_prefix_cache and self.default_level != 1:
            raise ValueError(
                "keep_prefix_cache needs default_level 1: a level-2 sleep discards the "
                "weights and the KV cache"
            )
        return self

    @model_validator(mode="after")
    def _vllm_driver(self) -> ModelSettings:
        if self.accept_unverified_wake and self.sleep_driver != "vllm":
            raise ValueError(
                "accept_unverified_wake applies to sleep_driver: vllm only (the extension's "
                "wake is always verified)"
            )
        if self.sleep_driver != "vllm":
            return self
        if self.keep_prefix_cache:
            raise ValueError(
                "sleep_driver vllm cannot keep_prefix_cache: vLLM's /sleep discards the KV "
                "cache and clears its prefix cache"
            )
        if self.deep_sleep != "off":
            raise ValueError(
                "sleep_driver vllm needs deep_sleep off: the driver's checkpoint follows the "
                "extension's sleep (docs/contracts.md §2.2)"
            )
        return self

    @property
    def managed(self) -> bool:
        return self.command is not None

    @property
    def placement(self) -> tuple[str, ...]:
        return tuple(self.devices) if self.devices else (self.device,)


# ----------------------------------------------------------------------------- placement

VISIBLE = "CUDA_VISIBLE_DEVICES"


def _tp_flag(argv: Sequence[str], *flags: str) -> str | None:
    for i, arg in enumerate(argv):
        for flag in flags:
            if arg == flag:
                return argv[i + 1] if i + 1 < len(argv) else ""
            if arg.startswith(flag + "="):
                return arg[len(flag) + 1 :]
    return None


def tp_size(m: ModelSettings) -> int:
    """The devices a model's engine needs: `tp_size`, else its command's TP flag, else 1."""
    raw = _tp_flag(m.command or [], "--tensor-parallel-size", "-tp")
    flag: int | None = None
    if raw is not None:
        try:
            flag = int(raw)
        except ValueError:
            raise ValueError(
                f"model {m.name}: --tensor-parallel-size {raw!r} is not a number"
            ) from None
    if m.tp_size is not None and flag is not None and flag != m.tp_size:
        raise ValueError(
            f"model {m.name}: tp_size {m.tp_size} but its command says "
            f"--tensor-parallel-size {flag}"
        )
    return m.tp_size or flag or 1


def resolve(models: Sequence[ModelSettings], declared: Sequence[str] | None) -> list[ModelSettings]:
    """Placement (controller.config.placement.place over the models' wishes): every model with
    `devices` filled in (and `device` = its first); managed models placed on `declared`
    devices (swap.devices) or naming `devices` get CUDA_VISIBLE_DEVICES. A model that cannot
    be placed raises ValueError with one line."""
    wants = []
    for m in models:
        n = tp_size(m)
        if m.devices:
            named = tuple(m.devices)
            sized = m.tp_size is not None or _tp_flag(
                m.command or [], "--tensor-parallel-size", "-tp"
            )
            if sized and len(named) != n:
                raise ValueError(
                    f"model {m.name}: {len(named)} device(s) {list(named)} for tensor "
                    f"parallel size {n}; name {n} devices, or leave them to swap.devices"
                )
            wants.append(Want(m.name, named, len(named)))
        elif declared is None or not m.managed or "device" in m.model_fields_set:
            wants.append(Want(m.name, (m.device,), 1))  # as configured (one device)
        else:
            wants.append(Want(m.name, (), n))  # assigned from swap.devices
    available = list(declared) if declared is not None else []
    if declared is None:
        for w in wants:
            available.extend(d for d in w.devices if d not in available)
    placed = place(wants, available)
    out = []
    for m in models:
        devs = placed[m.name]
        env = dict(m.env)
        if m.managed and (declared is not None or m.devices):
            if VISIBLE in env and env[VISIBLE] != ",".join(devs):
                raise ValueError(
                    f"model {m.name}: env {VISIBLE}={env[VISIBLE]!r} disagrees with its "
                    f"placement {list(devs)}; set `devices` (or swap.devices), not the env"
                )
            env[VISIBLE] = ",".join(devs)
        out.append(m.model_copy(update={"devices": list(devs), "device": devs[0], "env": env}))
    return out
