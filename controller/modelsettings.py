"""One model's settings: an entry of the models file (`Settings.models`).

An engine the sidecar knows by name: attached (someone else runs it at `url` or on `uds`),
or managed (its `command` is the argv the supervisor starts, on a socket of its own).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from pydantic import BaseModel, Field, field_validator, model_validator

from controller.state import Gate

MAX_BYTES = 1 << 50  # 1 PiB: a memory budget or footprint, far above any device


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

    name: str = Field(pattern=r"^[A-Za-z0-9][A-Za-z0-9._-]{0,62}$")
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
    device: str = Field("0", description="Models on one device share its memory budget.")
    keep_prefix_cache: bool = Field(
        False,
        description="Level-1 sleeps keep the KV cache (offloaded to pinned host memory, as big "
        "as the KV pool), so vLLM's prefix cache still hits after the wake; a sleep request's "
        "`keep_prefix_cache` overrides it. Default off: it costs the KV pool's host RAM and "
        "its copy time at sleep and wake.",
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
    def _strip_slash(cls, v: str) -> str:
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

    @property
    def managed(self) -> bool:
        return self.command is not None
