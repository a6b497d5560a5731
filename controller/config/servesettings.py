"""How the sidecar is reached: the control API's bind and limits, the bearer token, and the
gateway's bind, queue and limits (sections of `controller.config.settings.Settings`)."""

from __future__ import annotations

import ipaddress
from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field, SecretStr, field_validator, model_validator

from controller.config.bounds import DAY_S, HOUR_S, MiB


class ServerSettings(BaseModel):
    """The control API (sleep, wake, state, audit, probes, metrics): its bind and limits."""

    host: str = Field(
        "127.0.0.1", description="Bind address of the control API; loopback by default."
    )
    port: int = Field(
        8800, ge=0, le=65535, description="Port of the control API (0 = pick a free one)."
    )
    insecure: bool = Field(
        False,
        description="Allow a non-loopback bind of the control API or the gateway without a "
        "token (then both answer anyone); without it such a start is refused.",
    )
    docs: bool = Field(
        False, description="Serve /docs, /redoc and /openapi.json on the control port."
    )
    max_body_bytes: int = Field(
        64 << 10,
        ge=1024,
        le=16 * MiB,
        description="Largest control request body (bytes); its bodies are a few dozen bytes. "
        "Larger: 413, on Content-Length or on the streamed count.",
    )
    max_json_depth: int = Field(
        16, ge=2, le=256, description="Deepest JSON nesting of a control body; deeper: 400."
    )
    header_timeout_s: float = Field(
        10.0,
        gt=0,
        le=HOUR_S,
        description="Seconds (both ports) a connection has to send a whole request head; "
        "then it is closed. A real client sends it in one packet; a slow one holds a socket "
        "and a file descriptor for nothing.",
    )
    body_timeout_s: float = Field(
        60.0,
        gt=0,
        le=HOUR_S,
        description="Seconds (both ports) a request has, from its head, to send its whole "
        "body; then 408 and the connection closes (at the gateway's 4 MiB cap, 70 KB/s).",
    )
    keep_alive_s: float = Field(
        5.0,
        gt=0,
        le=HOUR_S,
        description="Seconds an idle keep-alive connection is kept (uvicorn's timeout_keep_alive).",
    )
    max_unauthenticated: int = Field(
        64,
        ge=1,
        le=65_536,
        description="Connections per port that may wait for their first request head (none "
        "has shown a token yet); one more is closed at once, so idle sockets cannot use up "
        "the process's file descriptors.",
    )
    max_connections: int = Field(
        512,
        ge=1,
        le=65_536,
        description="Connections (or requests in progress) per port; past it uvicorn "
        "answers 503 (limit_concurrency).",
    )


def clean_token(raw: str, source: str) -> str:
    """The token as it will be compared: stripped (a Secret file's trailing newline), and
    refused when empty or holding anything but visible ASCII (a header cannot carry it)."""
    token = raw.strip()
    if not token:
        raise ValueError(f"{source} is empty; unset it to disable auth")
    if not all("!" <= c <= "~" for c in token):
        raise ValueError(
            f"{source} may hold only visible ASCII characters "
            "(no spaces, control characters or non-ASCII)"
        )
    return token


class AuthSettings(BaseModel):
    """The bearer token of the control routes (and, by default, the gateway's /v1 routes)."""

    # Never echo a rejected value: it may be the token.
    model_config = ConfigDict(hide_input_in_errors=True)

    token: SecretStr | None = Field(
        None,
        description="Bearer token for control endpoints; None disables auth (loopback only). "
        "Stripped at start; empty or with control characters: refused.",
    )
    token_file: Path | None = Field(
        None,
        description="Read the token from this file (a mounted Secret) instead of `token`, "
        "so it is in no environment; stripped like `token`.",
    )
    guard_gateway: bool = Field(
        True,
        description="Without gateway tokens: the control token (when set) also guards the "
        "gateway's /v1 routes (then an inference client can sleep and audit too).",
    )
    gateway_tokens: list[SecretStr] | None = Field(
        None,
        description="The gateway's own bearer tokens (any one opens /v1; none opens the "
        "control API), so a client that may infer cannot sleep, wake or audit. Cleaned like "
        "`token`. From the environment: a JSON list.",
    )
    gateway_token_file: Path | None = Field(
        None,
        description="Read the gateway tokens from this file (a mounted Secret): one per "
        "line, blank lines and lines starting with # skipped.",
    )

    @field_validator("token")
    @classmethod
    def _clean(cls, v: SecretStr | None) -> SecretStr | None:
        return None if v is None else SecretStr(clean_token(v.get_secret_value(), "auth.token"))

    @model_validator(mode="after")
    def _from_file(self) -> AuthSettings:
        if self.token_file is None:
            return self
        if self.token is not None:
            raise ValueError("set auth.token or auth.token_file, not both")
        try:
            raw = self.token_file.read_text()
        except (OSError, UnicodeDecodeError) as exc:
            raise ValueError(f"auth.token_file {self.token_file}: {exc}") from None
        self.token = SecretStr(clean_token(raw, f"auth.token_file {self.token_file}"))
        return self

    @field_validator("gateway_tokens")
    @classmethod
    def _clean_all(cls, v: list[SecretStr] | None) -> list[SecretStr] | None:
        if v is None:
            return None
        if not v:
            raise ValueError("auth.gateway_tokens is empty; unset it to use the control token")
        return [SecretStr(clean_token(t.get_secret_value(), "auth.gateway_tokens")) for t in v]

    @model_validator(mode="after")
    def _gateway_from_file(self) -> AuthSettings:
        path = self.gateway_token_file
        if path is None:
            return self
        if self.gateway_tokens is not None:
            raise ValueError("set auth.gateway_tokens or auth.gateway_token_file, not both")
        try:
            lines = path.read_text().splitlines()
        except (OSError, UnicodeDecodeError) as exc:
            raise ValueError(f"auth.gateway_token_file {path}: {exc}") from None
        source = f"auth.gateway_token_file {path}"
        tokens = [clean_token(line, source) for line in lines if _a_token(line)]
        if not tokens:
            raise ValueError(f"{source} holds no token")
        self.gateway_tokens = [SecretStr(t) for t in tokens]
        return self

    def control_secrets(self) -> list[bytes] | None:
        """What opens the control API (None: it is open)."""
        return None if self.token is None else [self.token.get_secret_value().encode()]

    def gateway_secrets(self) -> list[bytes] | None:
        """What opens the gateway (None: it is open): its own tokens, else the control token
        when `guard_gateway` is on."""
        if self.gateway_tokens is not None:
            return [t.get_secret_value().encode() for t in self.gateway_tokens]
        return self.control_secrets() if self.guard_gateway else None


def _a_token(line: str) -> bool:
    text = line.strip()
    return bool(text) and not text.startswith("#")


class GatewaySettings(BaseModel):
    """The OpenAI-compatible gateway: routes /v1 requests by `model`, waking models on demand."""

    enabled: bool | None = Field(
        None, description="Serve the gateway; None = on when any model is managed (has a command)."
    )
    host: str = Field("127.0.0.1", description="Bind address of the gateway; loopback by default.")
    port: int = Field(
        8801, ge=0, le=65535, description="Port of the gateway (0 = pick a free one)."
    )
    queue_size: int = Field(
        16,
        ge=0,
        le=10_000,
        description="Requests held per model while it wakes; one more answers 429.",
    )
    hold_timeout_s: float = Field(
        120.0,
        gt=0,
        le=HOUR_S,
        description="Seconds a request may wait for its model; then 503 Retry-After.",
    )
    request_timeout_s: float = Field(
        600.0,
        gt=0,
        le=DAY_S,
        description="HTTP timeout of one forwarded request (long generations).",
    )
    retry_after_s: int = Field(
        5, ge=0, le=int(HOUR_S), description="Retry-After (seconds) sent with a 503."
    )
    max_body_bytes: int = Field(
        4 * MiB,
        ge=1024,
        le=256 * MiB,
        description="Largest /v1 request body (bytes): long prompts fit; raise it for longer "
        "ones (or inline images). Larger: 413, on Content-Length or on the streamed count.",
    )
    max_json_depth: int = Field(
        64, ge=2, le=256, description="Deepest JSON nesting of a /v1 body; deeper: 400."
    )
    max_concurrent: int = Field(
        256,
        ge=1,
        le=65_536,
        description="Requests the gateway serves at once (held, forwarded and streaming, "
        "over all models); one more answers 429.",
    )
    max_body_buffer_bytes: int = Field(
        64 * MiB,
        ge=1024,
        le=64 * 1024 * MiB,
        description="Bytes of request bodies the gateway holds at once, over all requests "
        "(each at most max_body_bytes); a body that would pass it answers 429. The "
        "gateway's memory is about twice this plus the process: keep it well under the "
        "pod's limit (deploy/: 512Mi).",
    )


def is_loopback(host: str) -> bool:
    """Only this machine can reach `host` (a name other than localhost counts as open)."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False
