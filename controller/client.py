"""The client commands (`status`, `sleep`, `wake`): HTTP to a running sidecar, and how
their answers are printed. `ClientSettings` holds the flags' environment twins."""

from __future__ import annotations

import argparse
from datetime import UTC, datetime
from typing import Any, TextIO

import httpx
from pydantic import Field, ValidationError
from pydantic_settings import BaseSettings, SettingsConfigDict

from controller.errors import EXIT_OK, CliError

DEFAULT_URL = "http://127.0.0.1:8800"
# A wait=true sleep or wake can legitimately take minutes (a level-2 reload reads a checkpoint).
DEFAULT_CLIENT_TIMEOUT_S = 900.0


class ClientSettings(BaseSettings):
    """Where the client commands find the sidecar. Flags win over these environment twins."""

    model_config = SettingsConfigDict(env_prefix="HOTSWAP_", env_ignore_empty=True, extra="ignore")

    url: str = Field(DEFAULT_URL, description="Sidecar URL (HOTSWAP_URL).")
    token: str | None = Field(None, description="Bearer token (HOTSWAP_TOKEN).")
    client_timeout: float = Field(
        DEFAULT_CLIENT_TIMEOUT_S, gt=0, description="Seconds to wait (HOTSWAP_CLIENT_TIMEOUT)."
    )

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> ClientSettings:
        given = {"url": args.url, "token": args.token, "client_timeout": args.timeout}
        try:
            return cls(**{k: v for k, v in given.items() if v is not None and v != ""})
        except ValidationError as exc:
            reasons = "; ".join(f"{'.'.join(map(str, e['loc']))}: {e['msg']}" for e in exc.errors())
            raise CliError(f"invalid client settings: {reasons}") from None

    @property
    def base_url(self) -> str:
        return self.url.rstrip("/")

    def client(self) -> httpx.Client:
        headers = {"Authorization": f"Bearer {self.token}"} if self.token else {}
        return httpx.Client(base_url=self.base_url, headers=headers, timeout=self.client_timeout)


class HttpFailure(Exception):
    def __init__(self, status: int, reason: str) -> None:
        super().__init__(f"HTTP {status}: {reason}")
        self.status = status
        self.reason = reason


def _check(resp: httpx.Response, ok: tuple[int, ...] = (200, 202)) -> dict[str, Any]:
    try:
        body = resp.json()
    except ValueError:
        body = None
    if resp.status_code not in ok:
        if isinstance(body, dict) and "message" in body:
            extra = {k: v for k, v in body.items() if k not in ("error", "message", "details")}
            reason = f"{body.get('error', 'error')}: {body['message']}"
            if extra:
                reason += " (" + ", ".join(f"{k}={v}" for k, v in extra.items()) + ")"
        else:
            reason = resp.text.strip()[:500] or resp.reason_phrase
        raise HttpFailure(resp.status_code, reason)
    if not isinstance(body, dict):
        raise HttpFailure(resp.status_code, "the answer is not a JSON object")
    return body


def _fmt_time(ts: Any) -> str:
    """A readable time: GET /models' compact ISO 8601 as it is, unix seconds converted."""
    if isinstance(ts, str) and ts:
        return ts
    if not isinstance(ts, int | float) or isinstance(ts, bool):
        return "-"
    return datetime.fromtimestamp(ts, tz=UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def _fmt_transition(t: Any) -> str:
    if not isinstance(t, dict):
        return "-"
    text = f"{t.get('kind')} {_result(t.get('result'))} in {t.get('duration_s', 0.0):.3f} s"
    if t.get("error"):
        text += f" ({t.get('failed_phase') or '?'}: {t['error']})"
    return text


def _result(result: Any) -> str:
    """A transition's result as a sentence says it: ok is done."""
    return "done" if result == "ok" else str(result)


def format_status(models: list[dict[str, Any]], health: dict[str, Any] | None) -> str:
    header = ("MODEL", "STATE", "LEVEL", "VERIFIED", "READY", "SINCE", "LAST TRANSITION")
    rows = [header]
    for m in models:
        level = m.get("level")
        rows.append(
            (
                str(m.get("name")),
                str(m.get("state")),
                str(level) if level is not None else "-",
                "yes" if m.get("verified") else "no",
                "yes" if m.get("ready") else "no",
                _fmt_time(m.get("since")),
                _fmt_transition(m.get("last_transition")),
            )
        )
    widths = [max(len(r[i]) for r in rows) for i in range(len(header) - 1)]
    lines = [
        "  ".join(c.ljust(w) for c, w in zip(r[:-1], widths, strict=True)) + "  " + r[-1]
        for r in rows
    ]
    if health is not None:
        lines.append(f"sidecar ready: {'yes' if health.get('ready') else 'no'}")
    return "\n".join(lines)


def _headline(body: dict[str, Any]) -> str:
    """What the request did, in words: done (with how long), joined, or nothing to do."""
    who = f"{body.get('model')}: {body.get('state')}"
    action, t = body.get("action"), body.get("transition")
    if action == "noop" or not isinstance(t, dict):
        return f"{who}: nothing to do"
    done = f"{t.get('kind')} {_result(t.get('result'))} in {t.get('duration_s', 0.0):.3f} s"
    if t.get("error"):
        done += f" ({t.get('failed_phase') or '?'}: {t['error']})"
    return f"{who}: {done}" if action == "begin" else f"{who}: joined the {done}"


def _policy_lines(policy: Any) -> list[str]:
    """A wake through the swap policy: what it decided and why, and what it put to sleep."""
    if not isinstance(policy, dict) or not isinstance(plan := policy.get("policy"), dict):
        return []
    lines = [f"  policy: {plan.get('decision')}: {plan.get('reason')}"]
    evicted = policy.get("evicted") or []
    if evicted:
        how = "overlapped with the wake" if policy.get("overlapped") else "then the wake"
        lines.append(
            f"  evicted {', '.join(map(str, evicted))} in {policy.get('evict_s', 0.0):.3f} s "
            f"({how}); swap {policy.get('swap_s', 0.0):.3f} s"
        )
    return lines


def format_outcome(body: dict[str, Any]) -> str:
    lines = [_headline(body), *_policy_lines(body.get("policy"))]
    t = body.get("transition")
    for p in t.get("phases") or [] if isinstance(t, dict) else []:
        mark = "ok" if p.get("ok") else "FAILED"
        ranks = len(p.get("ranks") or [])  # an engine step (/pause, /resume) reports none
        where = f"  ranks={ranks}" if ranks else ""
        lines.append(f"  {p.get('name'):<20} {p.get('duration_s', 0.0):8.3f} s  {mark}{where}")
    return "\n".join(lines)


def cmd_status(args: argparse.Namespace, out: TextIO) -> int:
    opts = ClientSettings.from_args(args)
    with opts.client() as client:
        models = _check(client.get("/models"), ok=(200,))
        health = _check(client.get("/health"), ok=(200, 503))
    out.write(format_status(list(models.get("models") or []), health) + "\n")
    return EXIT_OK


def cmd_transition(args: argparse.Namespace, out: TextIO) -> int:
    opts = ClientSettings.from_args(args)
    params = {"wait": "false" if args.no_wait else "true"}
    body: dict[str, Any] | None = None
    if args.command == "wake" and args.no_evict:
        params["evict"] = "false"
    if args.command == "sleep":
        body = {}
        if args.keep_prefix_cache:
            body["keep_prefix_cache"] = True
        if args.level is not None:
            body["level"] = args.level
        if args.drain is not None:
            body["drain"] = args.drain
        if args.drain_timeout is not None:
            body["drain_timeout_s"] = args.drain_timeout
    with opts.client() as client:
        resp = client.post(f"/models/{args.name}/{args.command}", params=params, json=body)
    answer = _check(resp)
    if resp.status_code == 202:
        where = resp.headers.get("location", f"/models/{args.name}")
        out.write(f"{args.name}: accepted ({answer.get('state')}); poll {opts.base_url}{where}\n")
    else:
        out.write(format_outcome(answer) + "\n")
    return EXIT_OK
