"""The sidecar's error tree, in one module. Library errors are translated into these in one
place (the engine adapter, controller.engines.engine._send), rank failures in one place (the step
runner, controller.models.runner), and errors are mapped to HTTP status codes in one place
(`http_status`). The gateway answers OpenAI-shaped bodies from the same classes.

    HotswapError                      502 unless a child says otherwise
     ├── ModelNotFound                404
     ├── TransitionConflict           409  the opposite transition runs, or the state forbids it
     │    └── WakeRefused             409  the swap policy says no (the plan attached)
     ├── DeepSleepRefused             422  a deep sleep cannot be done here (nothing changed)
     ├── Unauthorized                 401
     ├── DrainTimeout                 504  drain=wait gave up; still RUNNING, nothing touched
     ├── Refusal                      4xx/5xx  the gateway answers a /v1 request itself
     ├── NotAdmitting                 503  starting or shutting down: no sleep or wake now
     ├── EngineStartError             502  an engine process would not start (engines.launcher)
     └── EngineError                  502  the engine answered wrongly: FAILED
          ├── EngineUnavailable       502  not reachable
          ├── EngineTimeout           504  no answer in time; for an RPC the ranks are unknown
          ├── RankError               502  a rank said ok: false (engines.engine; reports kept)
          ├── VerificationFailed      502  tensors differ after a wake (named)
          └── BarrierTimeout          504  quiesce: ranks missed the barrier (named)

    CliError                          the command line or configuration (exit code EXIT_USAGE)
"""

from __future__ import annotations

from collections.abc import Mapping

# The `hotswap` command's exit codes.
EXIT_OK = 0
EXIT_HTTP_ERROR = 1  # the sidecar answered with an error status
EXIT_USAGE = 2  # bad arguments or configuration (argparse uses 2 as well)
EXIT_UNREACHABLE = 3  # no answer from the sidecar
EXIT_STARTUP = 4  # serve: the app did not start (port taken, lifespan failed)


class CliError(Exception):
    """A problem with the command line or configuration, reported without a traceback."""


class HotswapError(Exception):
    """Root of every error the sidecar raises on purpose."""

    status = 502
    may_desync = False  # see EngineError

    def __init__(self, message: str, *, model: str | None = None, phase: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.model = model
        self.phase = phase

    def to_dict(self) -> dict[str, object]:
        out: dict[str, object] = {"error": type(self).__name__, "message": self.message}
        if self.model is not None:
            out["model"] = self.model
        if self.phase is not None:
            out["phase"] = self.phase
        return out


class ModelNotFound(HotswapError):
    status = 404


class TransitionConflict(HotswapError):
    """The requested transition cannot run now (opposite one in flight, or FAILED)."""

    status = 409


class Unauthorized(HotswapError):
    status = 401


class EngineError(HotswapError):
    """The engine answered, but not as it should (5xx, bad body, ok=false from a rank).

    `may_desync`: the call may have left vLLM's RPC reply queues out of step (it was sent and
    no whole answer came back: a read timeout, a connection broken after sending, a 5xx).
    False when nothing was delivered (no connection) or every rank answered."""

    status = 502
    may_desync = True

    def to_dict(self) -> dict[str, object]:
        out = super().to_dict()
        out["queues_may_be_out_of_step"] = self.may_desync
        return out


class EngineUnavailable(EngineError):
    """The engine could not be reached (connection refused or reset)."""

    status = 502


class EngineTimeout(EngineError):
    """The engine did not answer in time; for an RPC the ranks are unknown."""

    status = 504


class EngineStartError(HotswapError):
    """An engine process exited or stayed unready past its deadline; the log tail says why."""

    status = 502


class DrainTimeout(HotswapError):
    """drain=wait gave up: in-flight requests outlasted the drain timeout; still RUNNING."""

    status = 504


class VerificationFailed(EngineError):
    """A tensor that must survive differs after the wake: the model stays out of rotation."""

    status = 502
    may_desync = False  # every rank answered

    def __init__(
        self,
        message: str,
        *,
        tensors: list[str],
        model: str | None = None,
        phase: str = "restore_and_verify",
    ) -> None:
        super().__init__(message, model=model, phase=phase)  # or the fused resume_and_verify
        self.tensors = tensors

    def to_dict(self) -> dict[str, object]:
        out = super().to_dict()
        out["tensors"] = self.tensors
        return out


class BarrierTimeout(EngineError):
    """Quiesce: some ranks missed the barrier; they are named."""

    status = 504
    may_desync = False  # every rank answered

    def __init__(self, message: str, *, late_ranks: list[int], model: str | None = None) -> None:
        super().__init__(message, model=model, phase="quiesce")
        self.late_ranks = late_ranks

    def to_dict(self) -> dict[str, object]:
        out = super().to_dict()
        out["late_ranks"] = self.late_ranks
        return out


class Refusal(HotswapError):
    """A /v1 request the gateway answers itself (OpenAI-shaped body); its status is its own."""

    def __init__(
        self,
        status: int,
        reason: str | None,
        message: str,
        *,
        retry_after_s: float | None = None,
        detail: Mapping[str, object] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.reason = reason  # the hotswap_gateway_refused_total label, when it counts
        self.retry_after_s = retry_after_s
        self.detail = dict(detail or {})


class NotAdmitting(HotswapError):
    """A sleep or wake asked while the sidecar starts (its start-up reconciliation) or shuts
    down (a SIGTERM's drain and stop): refused before anything is asked of the model."""

    status = 503

    def __init__(
        self, message: str, *, reason: str, retry_after_s: float, model: str | None = None
    ) -> None:
        super().__init__(message, model=model)
        self.reason = reason  # "starting" or "shutting_down"
        self.retry_after_s = retry_after_s

    def to_dict(self) -> dict[str, object]:
        out = super().to_dict()
        out["reason"] = self.reason
        return out


def http_status(exc: BaseException) -> int:
    """The one mapping from error class to HTTP status."""
    if isinstance(exc, HotswapError):
        return exc.status
    return 502


class WakeRefused(TransitionConflict):
    """The swap policy will not wake the model now (over budget, evict=false, pinned peers)."""

    status = 409

    def __init__(
        self,
        message: str,
        *,
        plan: dict[str, object],
        retry_after_s: float | None = None,
        model: str | None = None,
    ) -> None:
        super().__init__(message, model=model, phase="policy")
        self.plan = plan
        self.retry_after_s = retry_after_s

    def to_dict(self) -> dict[str, object]:
        out = super().to_dict()
        out["plan"] = self.plan
        return out


class DeepSleepRefused(HotswapError):
    """A deep sleep asked where it cannot be done (a CPU engine, no driver or no checkpoint
    API, processes out of reach, fewer CUDA processes than ranks): the model is as it was."""

    status = 422
