"""`hotswap`: vLLM's sleep-mode backend that runs the verified path (docs/contracts.md §1.5).

vLLM's own `/sleep`, `/wake_up`, `LLM.sleep()` and `LLM.wake_up()` reach the worker's
`sleep()`/`wake_up()`, which call its sleep-mode backend. This one drives the worker
extension's own steps in the worker it is bound to (`HotSwapWorker` binds it), so a sleep made
through vLLM is the sidecar's sleep: audited, protected by range, fingerprinted, and its
wake verified bit for bit. It adds no memory logic of its own.

A wake that cannot be verified ends the process (fail closed): the call never returns, so
vLLM never resumes its scheduler and no token is served from unverified memory.

`state()` is read from the rank's truth, whoever moved it; `vllm_sleep` says whether vLLM's
own sleep is in force (its executor holds itself asleep), which the sidecar's RPCs cannot
end: its wake ends it through vLLM's `/wake_up` (docs/contracts.md §1.5).
"""

from __future__ import annotations

import logging
import os
import sys
from typing import TYPE_CHECKING, Any, Literal

from worker_ext import vllmcompat

log = logging.getLogger("worker_ext.sleepbackend")

EXIT_STATUS = 70  # EX_SOFTWARE: the wake could not be verified
QUIESCE_TIMEOUT_S = 60.0
TAGS = ("weights", "kv_cache")
SHOWN = 16  # mismatched names logged

State = Literal["RUNNING", "SUSPENDED", "RESUMING"]

if TYPE_CHECKING:
    _Base = object
else:
    _Base = vllmcompat.backend_base() or object


class Refused(RuntimeError):
    """A sleep or wake refused before any memory moved: the engine is as it was."""


class HotSwapSleepBackend(_Base):
    """vLLM's `SleepModeBackend` over the worker extension's RPC methods (called in-process
    on the bound worker: they never raise and answer plain dicts)."""

    def __init__(self, worker: Any = None) -> None:
        super().__init__()
        self._worker = worker
        self._resuming = False
        # vLLM's own sleep is in force: a suspend vLLM's sleep() asked for passed, and no
        # resume vLLM's wake_up() asked for has brought every pool back since
        self.vllm_sleep = False

    # -- vLLM's interface --------------------------------------------------------------

    def state(self) -> State:
        """The rank's truth, whoever moved it (vLLM through here, or the sidecar's RPCs)."""
        if self._resuming:
            return "RESUMING"
        if self._worker is not None and self._asleep(self._worker):
            return "SUSPENDED"
        return "RUNNING"

    def suspend(self, level: int = 1) -> None:
        """Refused (Refused, nothing released) or done; failed after release: the process
        ends (fail closed)."""
        w = self._bound()
        if level not in (1, 2):
            raise Refused(f"sleep level must be 1 or 2, not {level!r}")
        asleep = self._asleep(w)
        if asleep:
            raise Refused(f"already asleep (pools {sorted(asleep)}): wake it first")
        quiet = w.hotswap_quiesce(QUIESCE_TIMEOUT_S)
        if not quiet.get("ok"):
            raise Refused(f"quiesce failed, nothing released: {quiet.get('error')}")
        rep = w.hotswap_sleep(int(level))
        if not rep.get("ok"):
            if rep.get("failed_step") == "suspend":
                self._fail_closed("suspend", rep)
            raise Refused(f"sleep refused, nothing released: {rep.get('error')}")
        self.vllm_sleep = True
        log.info(
            "hotswap: asleep at level %s (%s protected bytes, %s fingerprinted)",
            level,
            rep.get("protected_bytes"),
            rep.get("fingerprinted"),
        )

    def resume(self, tags: list[str] | None = None) -> None:
        """Map back `tags` (None: every pool asleep); the resume that brings back the last
        pool restores and verifies, and returns only when the verify passed."""
        w = self._bound()
        asleep = self._asleep(w)
        chosen = sorted(asleep) if tags is None else [str(t) for t in tags]
        wrong = [t for t in chosen if t not in asleep]
        if wrong:
            raise Refused(f"not asleep: {wrong} (asleep: {sorted(asleep)})")
        if not chosen:
            # nothing asleep: the sidecar's RPCs woke and verified it; vLLM's wake only
            # ends vLLM's own sleep here (docs/contracts.md §1.5)
            if self.vllm_sleep:
                log.info("hotswap: vLLM's wake of a sleep already woken and verified")
            self.vllm_sleep = False
            return
        self._resuming = True
        try:
            self._resume(w, chosen, rest=asleep - set(chosen))
        finally:
            self._resuming = False

    def _resume(self, w: Any, chosen: list[str], rest: set[str]) -> None:
        if rest:  # a tag-split wake: map these back, verify with the last
            self._step(w, "resume", w.hotswap_resume(chosen))
            return
        if self._level(w) == 2 and "weights" in chosen:
            # the weights come back last: nobody else can reload them in between
            self._step(w, "resume", w.hotswap_resume(["weights"]))
            self._step(w, "reload", w.hotswap_reload())
        self._step(w, "wake", w.hotswap_wake())
        self.vllm_sleep = False
        log.info("hotswap: awake and verified")

    def discard(self, tags: tuple[str, ...]) -> None:
        """vLLM 0.32's selective discard: not supported (nothing would be verified)."""
        raise Refused(f"the hotswap backend does not discard pools selectively: {tags}")

    @classmethod
    def preserves_communicators(cls) -> bool:
        return True  # as vLLM's cumem: communicators live outside the allocator's pools

    # -- internals ---------------------------------------------------------------------

    def _bound(self) -> Any:
        if self._worker is None:
            raise Refused(
                "the hotswap sleep-mode backend needs its worker: start vLLM with "
                "--worker-cls worker_ext.HotSwapWorker"
            )
        return self._worker

    @staticmethod
    def _asleep(w: Any) -> set[str]:
        """The pools asleep on this rank, as the extension (the rank's truth) holds them."""
        return set(w._hotswap_state().backend.suspended())

    @staticmethod
    def _level(w: Any) -> int | None:
        level = w._hotswap_state().level
        return int(level) if level is not None else None

    def _step(self, w: Any, step: str, rep: dict[str, Any]) -> None:
        if not rep.get("ok"):
            self._fail_closed(step, rep)

    def _fail_closed(self, step: str, rep: dict[str, Any]) -> None:
        """Log what differs and end the process: it must never serve after this."""
        mismatched = list(rep.get("mismatched") or [])
        rank = rep.get("rank")
        log.critical(
            "hotswap: the %s step failed on rank %s; this engine must not serve and exits "
            "with status %d. Error: %s. Mismatched (%d): %s",
            step,
            rank,
            EXIT_STATUS,
            rep.get("error"),
            len(mismatched),
            mismatched[:SHOWN],
        )
        # also on stderr itself: the process may have no logging handler configured
        print(
            f"hotswap: FAIL CLOSED at {step} on rank {rank}: {rep.get('error')}; "
            f"mismatched: {mismatched[:SHOWN]}",
            file=sys.stderr,
            flush=True,
        )
        for handler in logging.getLogger().handlers + log.handlers:
            handler.flush()
        self._exit(EXIT_STATUS)
        raise SystemExit(EXIT_STATUS)  # not reached: os._exit does not return

    @staticmethod
    def _exit(status: int) -> None:
        os._exit(status)
