"""One reconciliation: what the engine reports -> the model's state and the one action to take.

Pure: no I/O, no asyncio, no clocks. The controller's state is a cache of what the ranks
hold; this module is the only place that turns what was read back from an engine (is it
reachable, `/health`, `/is_paused`, a non-RPC sign of which process answers, and every
rank's `hotswap_info`, read as `controller.reports.RankView`s) into a state. It is run at
start-up, after any failed step, and periodically for attached engines in every state; the
caller does the I/O and the action.

The rules are tried in order and the first that matches decides (`RULES`, mirrored in
docs/contracts.md §2.1 and checked against it by the tests). Invariants the table tests
hold over every combination of inputs:

- RUNNING only when every rank reports `awake_verified`, none is poisoned, the engine is
  unpaused and alive, and the ranks' boot ids are the ones probed (the verdict is verified).
- No RPC (`Do.PROBE`, `Do.RESUME_ENGINE`, `Do.FINISH_WAKE`) is asked of an engine whose
  queues may be out of step (an RPC to it timed out or failed) unless a non-RPC sign says
  the process answering is a new one.
"""

from __future__ import annotations

import enum
from collections.abc import Iterable
from dataclasses import dataclass, field, replace
from typing import Any

from controller.reports import Phase, RankView
from controller.state import State


class Do(enum.StrEnum):
    """The one action the caller takes after a verdict."""

    NONE = "none"  # the state stands; nothing to send
    PROBE = "probe"  # ask every rank: `hotswap_info`, then reconcile again with its answer
    RESUME_ENGINE = "resume_engine"  # `/resume`, check `/is_paused`, warm up: then RUNNING
    FINISH_WAKE = "finish_wake"  # [level 2: reload], restore_and_verify, /resume, warm-up


@dataclass(frozen=True)
class Observation:
    """What was read from the engine just now. `paused` and the ranks mean nothing when the
    engine was not reachable; `ranks` is None when `hotswap_info` was not asked."""

    reachable: bool  # /health answered at all
    alive: bool = True  # /health 200 (vLLM answers 503 once its engine core died)
    paused: bool = False  # /is_paused
    sleeping: bool | None = None  # /is_sleeping (paused or vLLM's executor asleep); None: unread
    process: str | None = None  # a non-RPC sign of the process (its start time); None: none
    ranks: tuple[RankView, ...] | None = None  # every rank's hotswap_info, in rank order
    info_error: str | None = None  # hotswap_info itself got no usable answer (timeout, 5xx)
    info_may_desync: bool = True  # that failure may have left the reply queues out of step
    detail: str = ""  # why it was unreachable or dead, for the reason
    served: tuple[str, ...] | None = None  # the names /v1/models lists (None: not read)


@dataclass(frozen=True)
class Memory:
    """What the controller remembers of this engine between reconciliations."""

    state: State = State.UNKNOWN  # the model's state now (the cache being reconciled)
    verified: bool = False
    desynced: bool = False  # an RPC to this process timed out or failed: send it nothing
    process: str | None = None  # the non-RPC sign last seen
    boot_ids: tuple[str | None, ...] | None = None  # the ranks' boot ids last probed
    fresh: bool = False  # a process this sidecar just started (managed, STARTING)
    # Which model the engine must be: the name it serves (configured, else the first
    # verified probe's) and the model class its ranks report (the first verified probe's).
    served: str | None = None
    model: str | None = None
    # docs/contracts.md §2.3: the model serves a plain vLLM engine whose wake nothing
    # verifies (`accept_unverified_wake`), and RUNNING now after such a wake (`unverified`).
    accept_unverified: bool = False
    unverified: bool = False
    # this sidecar put it to sleep through vLLM's plain sleep (which CPU ranks cannot show)
    plain_asleep: bool = False


@dataclass(frozen=True)
class Verdict:
    """The model's state (None with Do.PROBE: unchanged until probed) and the one action."""

    rule: str  # the id of the rule in RULES that decided
    state: State | None
    do: Do
    reason: str
    verified: bool = False
    level: int | None = None
    tags: tuple[str, ...] = ()  # the pools asleep (SUSPENDED)
    desynced: bool = False  # the flag to remember from now on
    process: str | None = None  # the sign to remember from now on
    boot_ids: tuple[str | None, ...] | None = None  # the boot ids to remember from now on
    new_process: bool = False  # the engine is a different process than last seen
    # SUSPENDED: what its ranks hold on their devices, summed (None: a rank did not say),
    # and the device bytes its wake takes for a while beyond the pools (0: none said)
    resident_bytes: int | None = None
    wake_scratch_bytes: int = 0
    # RUNNING or SUSPENDED, read from the ranks: the host RAM they keep pinned, summed
    host_backup_bytes: int = 0
    # read from the ranks and /v1/models: what the engine is (remembered once verified)
    model: str | None = None
    served: str | None = None
    # RUNNING after an accepted unverified wake (verified stays false: §2.3)
    unverified: bool = False
    # SUSPENDED by vLLM's own sleep: "hotswap" (the ranks say `vllm_sleep`) or "plain"
    vllm_asleep: str | None = None

    @property
    def sends_rpc(self) -> bool:
        return self.do in (Do.PROBE, Do.RESUME_ENGINE, Do.FINISH_WAKE)


@dataclass(frozen=True)
class Rule:
    id: str
    when: str  # the condition, as docs/contracts.md §2.1 states it
    state: str  # the resulting state, as the docs name it
    do: Do


RULES: tuple[Rule, ...] = (
    Rule("unreachable", "/health gets no answer", "FAILED", Do.NONE),
    Rule("dead", "/health answers 503 (vLLM's engine core died)", "FAILED", Do.NONE),
    Rule(
        "desynced",
        "an RPC to this process timed out or failed, and no non-RPC sign says a new "
        "process answers",
        "FAILED",
        Do.NONE,
    ),
    Rule(
        "cache-fits",
        "not probed; RUNNING (verified, or woken unverified where accepted), unpaused and "
        "not sleeping by vLLM's `/is_sleeping`, "
        "or SUSPENDED and paused; "
        "the non-RPC sign is known and unchanged",
        "unchanged",
        Do.NONE,
    ),
    Rule("probe", "not probed, and the cache cannot be trusted", "unchanged", Do.PROBE),
    Rule(
        "info-failed",
        "hotswap_info got no answer, or a rank answered `ok: false`",
        "FAILED",
        Do.NONE,
    ),
    Rule(
        "ranks-missing",
        "fewer or more reports than the ranks' `world_size`, or no rank at all",
        "FAILED",
        Do.NONE,
    ),
    Rule(
        "unreported", "a rank reports no known `phase` (an extension without it)", "FAILED", Do.NONE
    ),
    Rule("rank-failed", "a rank's phase is `failed` (its reason is kept)", "FAILED", Do.NONE),
    Rule("poisoned", "a rank's barrier group is poisoned", "FAILED", Do.NONE),
    Rule("mixed", "the ranks disagree on phase, level or pools asleep", "FAILED", Do.NONE),
    Rule(
        "not-ours",
        "the process was just started by this sidecar, but a rank made memory steps "
        "(`transitions` > 0): it is not the process started",
        "FAILED",
        Do.NONE,
    ),
    Rule(
        "not-this-model",
        "a rank reports another served name (`served_model_name`) or model class (`model`) "
        "than this model's (its configured `served_model_name`, else what this sidecar's "
        "first verified probe read), or /v1/models does not list that name",
        "FAILED",
        Do.NONE,
    ),
    Rule(
        "asleep-accepted",
        "every rank `awake_verified`, the engine paused, the model accepts an unverified "
        "wake (`accept_unverified_wake`, §2.3), and a rank's allocator holds pools asleep or "
        "this sidecar put it to sleep through vLLM's plain sleep (which CPU ranks do not "
        "show): vLLM's own sleep of a plain engine",
        "SUSPENDED",
        Do.NONE,
    ),
    Rule(
        "asleep-unseen",
        "every rank `awake_verified`, but a rank's allocator holds pools asleep: a sleep "
        "made through vLLM's own endpoints without the hotswap backend, whose wake nothing "
        "verifies",
        "FAILED",
        Do.NONE,
    ),
    Rule(
        "interrupted-sleep",
        "every rank `awake_verified`, the engine paused (a sleep stopped before it suspended)",
        "RESUMING",
        Do.RESUME_ENGINE,
    ),
    Rule("running", "every rank `awake_verified`, the engine unpaused", "RUNNING", Do.NONE),
    Rule(
        "suspended-unpaused",
        "every rank `suspended`, but the engine is unpaused (it would serve from freed memory)",
        "FAILED",
        Do.NONE,
    ),
    Rule(
        "suspended",
        "every rank `suspended` (same level and pools), the engine paused",
        "SUSPENDED",
        Do.NONE,
    ),
    Rule(
        "unverified-unpaused",
        "every rank `resumed_unverified`, but the engine is unpaused (it may have served "
        "unverified)",
        "FAILED",
        Do.NONE,
    ),
    Rule(
        "copies-gone",
        "every rank `resumed_unverified`, the engine paused, a rank holds no snapshot",
        "FAILED",
        Do.NONE,
    ),
    Rule(
        "interrupted-wake",
        "every rank `resumed_unverified` holding its snapshot, the engine paused",
        "RESUMING",
        Do.FINISH_WAKE,
    ),
)

_BY_ID = {r.id: r for r in RULES}


def _not_this_model(obs: Observation, mem: Memory, ranks: tuple[RankView, ...]) -> str | None:
    """Why the engine is not this model's (None: nothing says so). A rank or an answer that
    does not say is not held against it (an older extension, /v1/models not read)."""
    names = {r.served_model_name for r in ranks if r.served_model_name is not None}
    classes = {r.model for r in ranks if r.model is not None}
    if mem.served is not None and names - {mem.served}:
        return f"the ranks serve {sorted(names)}, not {mem.served!r}"
    if mem.served is not None and obs.served is not None and mem.served not in obs.served:
        return f"/v1/models lists {list(obs.served)}, not {mem.served!r}"
    if len(classes) > 1 or (mem.model is not None and classes - {mem.model}):
        return f"the ranks run {sorted(classes)}, not {mem.model!r}"
    return None


def _ranks_text(ranks: Iterable[RankView]) -> str:
    return "[" + ", ".join(str(r.rank) for r in ranks) + "]"


@dataclass(frozen=True)
class _Case:
    """One reconciliation's inputs and what every verdict carries: the process-level facts
    (derived once) and, once the ranks were read, what they say (`seen`)."""

    obs: Observation
    mem: Memory
    desynced: bool
    process: str | None
    boot_ids: tuple[str | None, ...] | None
    new_process: bool
    seen: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def of(cls, obs: Observation, mem: Memory) -> _Case:
        new_process = (
            obs.reachable
            and obs.process is not None
            and mem.process is not None
            and obs.process != mem.process
        )
        return cls(
            obs,
            mem,
            desynced=mem.desynced and not new_process,
            process=obs.process if obs.process is not None else mem.process,
            boot_ids=mem.boot_ids if not new_process else None,
            new_process=new_process,
        )

    @property
    def ranks(self) -> tuple[RankView, ...]:
        assert self.obs.ranks is not None
        return self.obs.ranks

    def verdict(self, rule: str, state: State | None, reason: str, **kw: Any) -> Verdict:
        fields: dict[str, Any] = {
            "desynced": self.desynced,
            "process": self.process,
            "boot_ids": self.boot_ids,
            "new_process": self.new_process,
        }
        fields.update(self.seen)
        fields.update(kw)
        return Verdict(rule, state, _BY_ID[rule].do, reason, **fields)


def reconcile(obs: Observation, mem: Memory) -> Verdict:
    """The state the engine's reports support, and the one action to take (see RULES)."""
    case = _Case.of(obs, mem)
    verdict = _engine_gone(case) or _unprobed(case) or _info_failed(case)
    if verdict is not None:
        return verdict
    ids = tuple(r.boot_id for r in case.ranks)
    new_boot = mem.boot_ids is not None and ids != mem.boot_ids
    case = replace(case, seen={"boot_ids": ids, "new_process": case.new_process or new_boot})
    verdict = _ranks_disagree(case) or _not_ours(case)
    if verdict is not None:
        return verdict
    served = mem.served
    if served is None and obs.served:
        served = obs.served[0]
    case = replace(
        case, seen=case.seen | {"model": mem.model or case.ranks[0].model, "served": served}
    )
    phase = case.ranks[0].phase
    if phase is Phase.AWAKE_VERIFIED:
        return _awake(case)
    if phase is Phase.SUSPENDED:
        return _suspended(case)
    return _resumed_unverified(case)


def _engine_gone(case: _Case) -> Verdict | None:
    """unreachable, dead, desynced: the process itself cannot be asked anything."""
    obs = case.obs
    if not obs.reachable:
        return case.verdict("unreachable", State.FAILED, _with("engine unreachable", obs.detail))
    if not obs.alive:
        return case.verdict("dead", State.FAILED, _with("/health 503: the engine died", obs.detail))
    if case.desynced:
        return case.verdict(
            "desynced",
            State.FAILED,
            "an RPC to this engine timed out or failed, so its reply queues may be out of "
            "step; nothing is sent to it until a new process answers (restart it)",
        )
    return None


def _unprobed(case: _Case) -> Verdict | None:
    """cache-fits or probe: hotswap_info was not asked yet."""
    obs, mem = case.obs, case.mem
    if obs.ranks is not None or obs.info_error is not None:
        return None
    awake = not obs.paused and obs.sleeping is not True
    served_ok = mem.verified or mem.unverified
    fits = (mem.state is State.RUNNING and served_ok and awake) or (
        mem.state is State.SUSPENDED and obs.paused
    )
    known = obs.process is not None and mem.process == obs.process
    if fits and known and mem.boot_ids is not None and not mem.fresh:
        return case.verdict(
            "cache-fits",
            mem.state,
            "the engine is as last probed",
            verified=mem.state is State.RUNNING and not mem.unverified,
            unverified=mem.state is State.RUNNING and mem.unverified,
        )
    return case.verdict("probe", None, "probe every rank")


def _info_failed(case: _Case) -> Verdict | None:
    """info-failed (no answer): a reply that never came (or a 5xx) may leave the queues
    out of step."""
    obs = case.obs
    if obs.info_error is None and obs.ranks is not None:
        return None
    return case.verdict(
        "info-failed",
        State.FAILED,
        _with("hotswap_info failed", obs.info_error),
        desynced=obs.info_may_desync,
    )


def _ranks_disagree(case: _Case) -> Verdict | None:
    """info-failed (a rank not ok), ranks-missing, unreported, rank-failed, poisoned, mixed:
    the ranks' answers do not make one consistent report."""
    ranks = case.ranks
    bad = [r for r in ranks if not r.ok]
    if bad:
        detail = "; ".join(f"rank {r.rank}: {r.error or 'ok is not true'}" for r in bad)
        return case.verdict("info-failed", State.FAILED, f"hotswap_info failed: {detail}")
    sizes = {r.world_size for r in ranks if r.world_size is not None}
    if not ranks or len(sizes) > 1 or (sizes and sizes != {len(ranks)}):
        return case.verdict(
            "ranks-missing",
            State.FAILED,
            f"{len(ranks)} rank reports for a world of size {sorted(sizes) or '?'}",
        )
    unreported = [r for r in ranks if r.phase is Phase.UNREPORTED]
    if unreported:
        return case.verdict(
            "unreported",
            State.FAILED,
            f"ranks {_ranks_text(unreported)} report no phase: a worker extension "
            "without the rank's own truth cannot be trusted",
        )
    failed = [r for r in ranks if r.phase is Phase.FAILED]
    if failed:
        why = "; ".join(f"rank {r.rank}: {r.reason or 'failed'}" for r in failed)
        return case.verdict("rank-failed", State.FAILED, f"rank failed: {why}")
    poisoned = [r for r in ranks if r.poisoned]
    if poisoned:
        return case.verdict(
            "poisoned",
            State.FAILED,
            f"ranks {_ranks_text(poisoned)}: barrier group poisoned by a timed-out quiesce",
        )
    if len({(r.phase, r.level, r.tags) for r in ranks}) > 1:
        said = ", ".join(
            f"rank {r.rank} {r.phase.value}"
            + (f" L{r.level}" if r.level is not None else "")
            + (f" {list(r.tags)}" if r.tags else "")
            for r in ranks
        )
        return case.verdict("mixed", State.FAILED, f"mixed ranks: {said}")
    return None


def _not_ours(case: _Case) -> Verdict | None:
    """not-ours, not-this-model: the engine that answers is not the one expected."""
    ranks = case.ranks
    if case.mem.fresh and any(r.transitions > 0 for r in ranks):
        n = max(r.transitions for r in ranks)
        return case.verdict(
            "not-ours",
            State.FAILED,
            f"the engine that answers made {n} memory steps: not the process just started",
        )
    wrong = _not_this_model(case.obs, case.mem, ranks)
    if wrong is not None:
        return case.verdict("not-this-model", State.FAILED, wrong)
    return None


def _awake(case: _Case) -> Verdict:
    """asleep-unseen, interrupted-sleep, running: every rank awake_verified."""
    ranks = case.ranks
    unseen = sorted({t for r in ranks for t in r.allocator_asleep})
    mem = case.mem
    plain = unseen or (mem.plain_asleep and not case.seen.get("new_process"))
    if plain and mem.accept_unverified and case.obs.paused:
        where = f"pools {unseen} asleep in vLLM's allocator" if unseen else "put to sleep"
        return case.verdict(
            "asleep-accepted",
            State.SUSPENDED,
            f"every rank awake, {where}: vLLM's own sleep of a plain engine (its wake will "
            "not be verified: accept_unverified_wake)",
            tags=tuple(unseen),
            vllm_asleep="plain",
        )
    if unseen:
        return case.verdict(
            "asleep-unseen",
            State.FAILED,
            f"every rank awake, but pools {unseen} asleep in vLLM's allocator: put to "
            "sleep through vLLM's own endpoints without the hotswap backend (its wake "
            "would not be verified); restart it",
        )
    if case.obs.paused:
        return case.verdict(
            "interrupted-sleep",
            State.RESUMING,
            "paused with every rank awake and verified (a sleep stopped before it "
            "suspended anything): resume it",
            unverified=case.mem.unverified and not case.seen.get("new_process"),
        )
    if case.mem.unverified and not case.seen.get("new_process"):
        return case.verdict(
            "running",
            State.RUNNING,
            "every rank awake; its last wake was vLLM's own, which nothing verified "
            "(accept_unverified_wake)",
            unverified=True,
            host_backup_bytes=sum(r.host_backup_bytes for r in ranks),
        )
    return case.verdict(
        "running",
        State.RUNNING,
        "every rank awake and verified",
        verified=True,
        host_backup_bytes=sum(r.host_backup_bytes for r in ranks),
    )


def _suspended(case: _Case) -> Verdict:
    """suspended-unpaused, suspended: every rank suspended alike."""
    ranks = case.ranks
    first = ranks[0]
    if not case.obs.paused:
        return case.verdict(
            "suspended-unpaused",
            State.FAILED,
            f"the engine is unpaused with pools {list(first.tags)} suspended",
        )
    return case.verdict(
        "suspended",
        State.SUSPENDED,
        f"every rank suspended at level {first.level}, pools {list(first.tags)}",
        level=first.level,
        tags=first.tags,
        resident_bytes=None
        if any(r.resident_bytes is None for r in ranks)
        else sum(r.resident_bytes or 0 for r in ranks),
        wake_scratch_bytes=sum(r.wake_scratch_bytes for r in ranks),
        host_backup_bytes=sum(r.host_backup_bytes for r in ranks),
        vllm_asleep="hotswap" if any(r.vllm_sleep for r in ranks) else None,
    )


def _resumed_unverified(case: _Case) -> Verdict:
    """unverified-unpaused, copies-gone, interrupted-wake: every rank resumed_unverified."""
    ranks = case.ranks
    if not case.obs.paused:
        return case.verdict(
            "unverified-unpaused",
            State.FAILED,
            "the engine is unpaused although its wake was never verified",
        )
    gone = [r for r in ranks if not r.snapshot_held]
    if gone:
        return case.verdict(
            "copies-gone",
            State.FAILED,
            f"resumed but not verified, and ranks {_ranks_text(gone)} no longer hold "
            "their protected copies: the wake cannot be finished",
        )
    return case.verdict(
        "interrupted-wake",
        State.RESUMING,
        "resumed but not verified, protected copies held: finish the wake (restore_and_verify)",
        level=ranks[0].level,
    )


def _with(what: str, detail: str | None) -> str:
    return f"{what}: {detail}" if detail else what


def rules_table() -> str:
    """RULES as the markdown table in docs/contracts.md §2.1 (the tests compare the two)."""
    lines = ["| rule | when | state | action |", "|---|---|---|---|"]
    lines += [f"| `{r.id}` | {r.when} | {r.state} | `{r.do.value}` |" for r in RULES]
    return "\n".join(lines)
