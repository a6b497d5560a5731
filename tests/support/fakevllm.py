"""The one fake vLLM OpenAI server (with the hotswap worker extension) of the unit tests,
behind httpx.MockTransport.

It keeps just enough state (paused, suspended pools, level, requests in flight) for the
manager's sleep and wake sequences, answers each `hotswap_*` RPC with one plausible dict
per rank, and pauses as vLLM 0.32 was measured to (docs/contracts.md, "Measured: pause
semantics"): a `/pause?mode=wait` waits for the requests in flight within its HTTP timeout
and stays paused when that runs out. Tests steer it per call: block until an asyncio.Event
is set, fail in a chosen way, answer with their own handler (`overrides`), or cost fake
seconds on a fake clock (`costs`).
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol

import httpx
from prometheus_client import CollectorRegistry

from controller.config.modelsettings import ModelSettings
from controller.config.settings import Settings, TimeoutSettings
from controller.engines.engine import EngineClient
from controller.fleet.supervisor import EngineFactory as ProcessFactory
from controller.sidecar import Sidecar

Failure = Literal["rank", "http500", "timeout", "unreachable", "mismatch"]

POOL_BYTES = {"weights": 4096, "kv_cache": 2048}
Override = Callable[[httpx.Request], Awaitable[httpx.Response]]


class Clock(Protocol):
    t: float


WAKE_PARTS = ("hotswap_resume", "hotswap_restore_and_verify")  # what hotswap_wake does
SLEEP_PARTS = ("hotswap_prepare", "hotswap_suspend")  # what hotswap_sleep does
_PARTS = {"hotswap_wake": WAKE_PARTS, "hotswap_sleep": SLEEP_PARTS}


@dataclass
class FakeVllm:
    name: str = "fake"
    world_size: int = 2
    paused: bool = False
    level: int | None = None
    suspended: dict[str, str] = field(default_factory=dict)
    pool_bytes: dict[str, int] = field(default_factory=lambda: dict(POOL_BYTES))  # per rank
    in_flight_s: float = 0.0  # how long the requests in flight still need to finish
    # A call's name: the RPC's method ("hotswap_suspend"), `/pause?wait` or `/pause?abort`,
    # or the path ("/resume"). `fail` also takes the bare path ("/pause").
    fail: dict[str, Failure] = field(default_factory=dict)
    overrides: dict[str, Override] = field(default_factory=dict)  # name -> own answer
    # name -> event the answer waits for; `entered[name]` is set when the call arrives
    gates: dict[str, asyncio.Event] = field(default_factory=dict)
    entered: dict[str, asyncio.Event] = field(default_factory=dict)
    clock: Clock | None = None  # advanced by `costs[name]` seconds per call
    costs: dict[str, float] = field(default_factory=dict)
    calls: list[str] = field(default_factory=list)
    # Each rank's own truth (docs/contracts.md §1.1), and the API server's start time.
    ranks: list[dict[str, Any]] = field(default_factory=list)
    started_at: float = 1_796_000_000.0
    # Keeping the KV cache (docs/contracts.md §1.3): a rank's refusal by rank, what a
    # suspended rank says it leaves on its device, what /reset_prefix_cache answers, and how
    # often it was called.
    kv_refusal: dict[int, str] = field(default_factory=dict)
    resident_bytes: int | None = 100
    reset_ok: bool = True
    prefix_resets: int = 0
    # The host budget (docs/contracts.md §1): what a rank keeps in host RAM after a wake (a
    # CUDA engine's pinned backup), held now, and what a suspend says its wake's scratch is.
    host_backup: int = 0
    backup_held: int = 0
    wake_scratch: int = 0
    # What a prepare answers as `demotable` (None: the key is left out, as older ranks do);
    # a demotion after a prepare that answered False is refused (CUDA, HOTSWAP_DEMOTABLE=0).
    demotable: bool | None = None
    # Completions that reached the engine while it was paused (they wait for /resume).
    held_while_paused: int = 0
    _resumed_event: asyncio.Event | None = None
    model_class: str = "FakeForCausalLM"  # hotswap_info's `model`
    # vLLM's own /sleep and /wake_up (docs/contracts.md §2.3): the sleep-mode backend they
    # run ("plain": vLLM's cumem or CPU's no-op, the ranks do not move; "hotswap": the
    # ranks move as for the extension's RPCs), whether a plain sleep shows in the ranks'
    # `allocator_asleep` (CUDA) or not (CPU), the executor's sleeping tags, and how often
    # `reload_weights` ran.
    sleep_backend: Literal["plain", "hotswap"] = "plain"
    allocator_shows: bool = False
    executor_asleep: set[str] = field(default_factory=set)
    reloads: int = 0

    def __post_init__(self) -> None:
        if not self.ranks:
            self.ranks = [self._fresh(r) for r in range(self.world_size)]

    def _fresh(self, rank: int) -> dict[str, Any]:
        return {
            "phase": "awake_verified",
            "phase_level": None,
            "phase_tags": [],
            "phase_reason": None,
            "transitions": 0,
            "verified_transition": 0,
            "snapshot_held": False,
            "boot_id": f"{self.started_at:.0f}-{rank}",
            "process_start_s": self.started_at,
            "pid": 1000 + rank,
        }

    def vllm_asleep(self) -> bool:
        """vLLM's executor holds itself asleep: a rank says vLLM's own sleep is in force
        (`set_truth(vllm_sleep=True)`: a sleep vLLM made through the hotswap backend)."""
        return any(r.get("vllm_sleep") is True for r in self.ranks)

    def set_truth(self, **truth: Any) -> None:
        """What every rank reports of itself from now on (e.g. phase="suspended")."""
        for r in self.ranks:
            r.update(truth)

    def fresh(self) -> None:
        """A new process: nothing paused or asleep, fresh ranks, a new start time."""
        self.started_at += 60.0
        self.paused, self.level, self.suspended = False, None, {}
        self.ranks = [self._fresh(r) for r in range(self.world_size)]

    def asleep(self, level: int = 1) -> FakeVllm:
        """As a sleep leaves it: paused, every pool suspended, every rank saying so."""
        self.paused, self.level = True, level
        self.suspended = {"weights": "offloaded" if level == 1 else "discarded"}
        self.suspended["kv_cache"] = "discarded"
        for r in self.ranks:
            r.update(phase="suspended", phase_level=level, phase_tags=sorted(self.suspended))
            r["snapshot_held"] = True
            r["transitions"] += 1
        return self

    requests: list[httpx.Request] = field(default_factory=list)

    def _resumed(self) -> asyncio.Event:
        """Set by the next /resume (what a completion sent to the paused engine waits for)."""
        if self._resumed_event is None:
            self._resumed_event = asyncio.Event()
        return self._resumed_event

    def transport(self) -> httpx.MockTransport:
        return httpx.MockTransport(self.handle)

    async def __call__(self, request: httpx.Request) -> httpx.Response:
        return await self.handle(request)

    def rpc_calls(self) -> list[str]:
        return [c for c in self.calls if c.startswith("hotswap_")]

    def _advance(self, seconds: float) -> None:
        if self.clock is not None:
            self.clock.t += seconds

    def block(self, method: str) -> asyncio.Event:
        """Make `method` wait for the returned event; `entered[method]` says it arrived."""
        self.gates[method] = asyncio.Event()
        self.entered[method] = asyncio.Event()
        return self.gates[method]

    async def handle(self, request: httpx.Request) -> httpx.Response:
        path = request.url.path
        method = path
        body: dict[str, Any] = {}
        if path == "/collective_rpc":
            body = json.loads(request.content)
            method = str(body["method"])
        elif path == "/pause":
            method = f"/pause?{request.url.params.get('mode', 'wait')}"
        self.calls.append(method)
        self.requests.append(request)
        held = path == "/v1/completions" and self.paused and not self.suspended
        if held:  # as measured: a request that reaches a paused engine waits for /resume
            self.held_while_paused += 1
            await self._resumed().wait()
        # The fused wake (hotswap_wake) and sleep (hotswap_sleep) are their parts in one
        # call: what a test sets on a part (cost, block, override, failure) applies to it
        # unless set on it by name.
        parts = _PARTS.get(method, ())
        names = [method, *parts]
        if method in self.costs or not parts:
            self._advance(self.costs.get(method, 0.0))
        else:
            self._advance(sum(self.costs.get(n, 0.0) for n in parts))
        for n in names:
            if n in self.entered:
                self.entered[n].set()
            if n in self.gates:
                await self.gates[n].wait()
        for n in names:
            if n in self.overrides:
                return await self.overrides[n](request)
        failure = next((f for n in names if (f := self.fail.get(n))), None)
        failure = failure or self.fail.get(path)
        if failure == "timeout":
            raise httpx.ReadTimeout(f"fake {method} timed out", request=request)
        if failure == "unreachable":
            raise httpx.ConnectError("fake connection refused", request=request)
        if failure == "http500":
            return httpx.Response(500, json={"error": {"message": f"fake {method} broke"}})
        if method == "reload_weights":  # vLLM's own: one None per rank
            self.reloads += 1
            return httpx.Response(200, json={"results": [None] * self.world_size})
        if path == "/collective_rpc":
            assert method != "hotswap_quiesce" or self.paused, "quiesce on an unpaused engine"
            results = [self._rank(method, r, body, failure) for r in range(self.world_size)]
            return httpx.Response(200, json={"results": results})
        return self._http(path, request)

    def _pause(self, request: httpx.Request) -> httpx.Response:
        """As measured: paused at once; a wait answers when the requests in flight are done,
        and an HTTP timeout before that leaves the engine paused."""
        self.paused = True
        if request.url.params.get("mode") == "abort":
            self.in_flight_s = 0.0
        else:
            budget = float(request.extensions["timeout"]["read"])
            if self.in_flight_s > budget:
                self._advance(budget)
                self.in_flight_s -= budget
                raise httpx.ReadTimeout("timed out", request=request)
            self._advance(self.in_flight_s)
            self.in_flight_s = 0.0
        return httpx.Response(200, json={"status": "paused"})

    def _http(self, path: str, request: httpx.Request) -> httpx.Response:
        if path == "/health":
            return httpx.Response(200)
        if path == "/is_paused":
            return httpx.Response(200, json={"is_paused": self.paused})
        if path == "/is_sleeping":
            asleep = self.paused or bool(self.suspended) or self.vllm_asleep()
            asleep = asleep or bool(self.executor_asleep)
            return httpx.Response(200, json={"is_sleeping": asleep})
        if path == "/sleep":
            return self._vllm_sleep(int(request.url.params.get("level", "1")))
        if path == "/wake_up" and self.executor_asleep:
            return self._vllm_wake(request.url.params.get_list("tags") or None)
        if path == "/pause":
            return self._pause(request)
        if path == "/wake_up":  # vLLM's own wake: its workers' backends end vLLM's sleep
            for r in self.ranks:
                r["vllm_sleep"] = False
            path = "/resume"  # then vLLM resumes its scheduler (nothing asleep any more)
        if path == "/resume":
            self.paused = False
            self._resumed().set()
            self._resumed_event = None
            return httpx.Response(200, json={"status": "resumed"})
        if path == "/reset_prefix_cache":
            self.prefix_resets += 1
            return httpx.Response(200, json={"success": self.reset_ok})
        if path == "/v1/models":
            return httpx.Response(200, json={"object": "list", "data": [{"id": self.name}]})
        if path == "/metrics":
            text = f"process_start_time_seconds {self.started_at}\n"
            return httpx.Response(200, text=text)
        if path == "/v1/completions":
            if self.paused or self.suspended:  # a real engine would hang or serve garbage
                return httpx.Response(500, json={"error": {"message": "would hang"}})
            return httpx.Response(200, json={"choices": [{"index": 0, "text": " a"}]})
        return httpx.Response(404, json={"detail": "Not Found"})

    def _vllm_sleep(self, level: int) -> httpx.Response:
        """vLLM's own sleep: pause, then its executor's workers run the backend."""
        self.paused = True
        if self.executor_asleep:  # vLLM: already sleeping, a warning and nothing else
            return httpx.Response(200, json={"status": "sleeping", "level": level})
        self.executor_asleep = {"weights", "kv_cache"}
        if self.sleep_backend == "hotswap":
            self.asleep(level)
            self.set_truth(vllm_sleep=True)
        elif self.allocator_shows:
            self.set_truth(allocator_asleep=sorted(self.executor_asleep))
        return httpx.Response(200, json={"status": "sleeping", "level": level})

    def _vllm_wake(self, tags: list[str] | None) -> httpx.Response:
        """vLLM's own wake of `tags`; the scheduler resumes once nothing is asleep."""
        chosen = set(self.executor_asleep if tags is None else tags)
        if chosen - self.executor_asleep:  # vLLM: a warning, nothing woken
            return httpx.Response(200, json={"status": "sleeping", "tags": tags})
        self.executor_asleep -= chosen
        if self.sleep_backend == "hotswap" and not self.executor_asleep:
            self.level, self.suspended = None, {}
            for r in self.ranks:
                r["transitions"] += 2  # the resume and the verify
                r.update(phase="awake_verified", phase_level=None, phase_tags=[])
                r.update(verified_transition=r["transitions"], vllm_sleep=False)
        elif self.allocator_shows:
            self.set_truth(allocator_asleep=sorted(self.executor_asleep))
        if self.executor_asleep:
            return httpx.Response(200, json={"status": "sleeping", "tags": tags})
        self.paused = False
        self._resumed().set()
        self._resumed_event = None
        return httpx.Response(200, json={"status": "awake", "tags": tags})

    @staticmethod
    def _step(me: dict[str, Any], **truth: Any) -> None:
        """One memory step of a rank; a failed rank stays failed (docs/contracts.md §1.1)."""
        me["transitions"] += 1
        if me["phase"] != "failed":
            me.update(truth)

    def _rank(
        self, method: str, rank: int, body: dict[str, Any], failure: str | None
    ) -> dict[str, Any]:
        args: list[Any] = list(body.get("args") or [])
        kwargs: dict[str, Any] = dict(body.get("kwargs") or {})
        out: dict[str, Any] = {"ok": True, "rank": rank, "elapsed_s": 0.001}
        if failure == "rank" and rank == self.world_size - 1:
            # Refused before it touched memory: the rank's phase does not move.
            return {"ok": False, "rank": rank, "elapsed_s": 0.001, "error": f"fake {method} failed"}
        me = self.ranks[rank]
        if method == "hotswap_info":
            out.update(
                world_size=self.world_size,
                platform="cpu",
                backend="host",
                vllm_version="0.0.fake",
                model=self.model_class,
                served_model_name=self.name,
                pools=dict(self.pool_bytes),
                device_memory={"rss": 1 << 20},
                suspended=dict(self.suspended),
                level=self.level,
                **{"poisoned": False, **me},
            )
            if self.resident_bytes is not None:
                held = self.resident_bytes if self.suspended else 1 << 20
                out["resident"] = {"bytes": held, "source": "nvml"}
            out["wake_scratch_bytes"] = self.wake_scratch if self.suspended else 0
            out["host_backup_bytes"] = self.backup_held
        elif method == "hotswap_quiesce":
            out.update(barrier_s=0.0005, late_ranks=[])
        elif method == "hotswap_audit":
            level = int(args[0] if args else kwargs.get("level", 1))
            tensors = [
                {
                    "name": "model.embed_scale",
                    "bytes": 4,
                    "kind": "attribute",
                    "pool": "weights",
                    "restored": level == 1,
                    "at_risk": level == 2,
                },
                {
                    "name": "model.layers.0.weight",
                    "bytes": 4096,
                    "kind": "parameter",
                    "pool": "weights",
                    "restored": True,
                    "at_risk": False,
                },
            ]
            risky = [t["name"] for t in tensors if t["at_risk"]]
            out.update(
                tensors=tensors,
                count=len(tensors),
                bytes=sum(int(t["bytes"]) for t in tensors),
                at_risk=risky,
                at_risk_bytes=4 * len(risky),
            )
        elif method == "hotswap_prepare":
            me["snapshot_held"] = True
            asked = args[1] if len(args) > 1 else kwargs.get("kv", "discard")
            refusal = self.kv_refusal.get(rank) if asked == "keep" else None
            out.update(
                protected=1,
                protected_bytes=4,
                fingerprinted=2,
                at_risk=["model.embed_scale"],
                kv="keep" if asked == "keep" and refusal is None else "discard",
                kv_reason=refusal,
            )
            if self.demotable is not None:
                out["demotable"] = self.demotable
        elif method == "hotswap_suspend":
            level = int(args[0] if args else kwargs.get("level", 1))
            chosen = args[1] if len(args) > 1 else kwargs.get("tags")
            tags = list(chosen) if chosen else list(self.pool_bytes)
            kv = args[2] if len(args) > 2 else kwargs.get("kv", "discard")
            weights = {"weights": self.pool_bytes["weights"]} if "weights" in tags else {}
            offloaded = weights if level == 1 else {}
            if kv == "keep" and "kv_cache" in tags:
                offloaded["kv_cache"] = self.pool_bytes["kv_cache"]
            if rank == 0:
                self.level = level
                self.suspended.update(
                    {t: "offloaded" if t in offloaded else "discarded" for t in tags}
                )
            asleep = sorted({*me.get("phase_tags", []), *tags})
            self._step(me, phase="suspended", phase_level=level, phase_tags=asleep)
            freed = {t: self.pool_bytes[t] for t in tags}
            out.update(
                level=level,
                tags=tags,
                kv=kv,
                freed_bytes=freed,
                offloaded_bytes=offloaded,
                memory_before=1 << 20,
                memory_after=(1 << 20) - sum(freed.values()),
            )
            if self.resident_bytes is not None:
                out["resident_bytes"] = self.resident_bytes
            out["wake_scratch_bytes"] = self.wake_scratch
            if level == 1 and "weights" in tags:
                self.backup_held = self.host_backup  # pinned anew (CUDA-like); 0: none
            out["host_backup_bytes"] = self.backup_held
        elif method == "hotswap_drop_backup":
            if self.suspended:
                return {**out, "ok": False, "error": "drop_backup: not awake"}
            out.update(freed_host_bytes={"weights": self.backup_held}, host_backup_bytes=0)
            if rank == self.world_size - 1:
                self.backup_held = 0
        elif method == "hotswap_demote":
            if self.level != 1 or self.suspended.get("weights") != "offloaded":
                return {**out, "ok": False, "error": "demote: not asleep at level 1"}
            if self.demotable is False:
                return {**out, "ok": False, "error": "demote: no level-2 protection"}
            held = self.backup_held  # a CUDA-like rank releases its pinned copy
            if rank == self.world_size - 1:
                self.level = 2
                self.suspended["weights"] = "discarded"
                self.backup_held = 0
            self._step(me, phase_level=2)
            freed = {"weights": held or self.pool_bytes["weights"]}
            out.update(level=2, freed_bytes=freed, host_backup_bytes=0)
            out["freed_host_bytes"] = {"weights": held, "kv_cache": 0}
        elif method == "hotswap_resume":
            tags = args[0] if args else kwargs.get("tags")
            tags = list(tags) if tags else list(self.suspended)
            if rank == self.world_size - 1:
                for t in tags:
                    self.suspended.pop(t, None)
                if not self.suspended:
                    self.level = None
            left = sorted(set(me["phase_tags"]) - set(tags))
            self._step(me, phase="suspended" if left else "resumed_unverified", phase_tags=left)
            if not self.suspended:
                self.backup_held = self.host_backup
            out.update(
                tags=tags,
                restored_bytes={t: self.pool_bytes.get(t, 0) for t in tags},
                memory_before=1 << 19,
                memory_after=1 << 20,
                host_backup_bytes=self.host_backup,
            )
        elif method == "hotswap_reload":
            self._step(me)
        elif method == "hotswap_wake":
            if self.level == 2 and "weights" in self.suspended:
                return {**out, "ok": False, "error": "level 2: reload the weights first"}
            resumed = self._rank("hotswap_resume", rank, {"args": [None]}, None)
            verified = self._rank("hotswap_restore_and_verify", rank, {}, failure)
            out.update({k: v for k, v in resumed.items() if k not in ("ok", "rank")})
            out.update(verified)
            if not verified["ok"]:
                out["failed_step"] = "restore_and_verify"
        elif method == "hotswap_sleep":
            level = int(args[0] if args else kwargs.get("level", 1))
            prepared = self._rank("hotswap_prepare", rank, {"args": [level]}, None)
            suspended = self._rank("hotswap_suspend", rank, {"args": [level]}, None)
            out.update({k: v for k, v in prepared.items() if k not in ("ok", "rank")})
            out.update({k: v for k, v in suspended.items() if k not in ("ok", "rank")})
            out["overlapped"] = False
        elif method == "hotswap_restore_and_verify":
            mismatched = ["model.embed_scale"] if failure == "mismatch" else []
            out.update(restored=1, rebound=[], verified=2, mismatched=mismatched)
            out["vllm_sleep"] = me.get("vllm_sleep", False)
            me["snapshot_held"] = False
            if mismatched:
                out.update(ok=False, error="fingerprint mismatch: model.embed_scale")
                self._step(me, phase="failed", phase_reason="verify: model.embed_scale differs")
            else:
                self._step(me, phase="awake_verified", phase_level=None, phase_tags=[])
                if me["phase"] == "awake_verified":
                    me["verified_transition"] = me["transitions"]
        else:
            return {"ok": False, "rank": rank, "elapsed_s": 0.0, "error": f"no method {method}"}
        return out


def wire(
    settings: Settings,
    transport: httpx.AsyncBaseTransport,
    *,
    process_factory: ProcessFactory | None = None,
) -> Sidecar:
    """The sidecar whose engine clients (and gateway) all go through `transport` (fake
    engines), with metrics on a fresh registry. Nothing is started yet."""

    def factory(model: ModelSettings, timeouts: TimeoutSettings) -> EngineClient:
        return EngineClient(model.url, transport=transport, timeouts=timeouts)

    return Sidecar(
        settings,
        registry=CollectorRegistry(),
        engine_factory=factory,
        process_factory=process_factory,
        gateway_transport=transport,
    )
