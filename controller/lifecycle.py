"""Where the sidecar is in its own life: starting, serving, or stopping.

The control port binds before the start-up reconciliation runs (a long one must not meet
the startupProbe and a kill loop), and a SIGTERM first stops admitting while the requests
in flight finish. Meanwhile readiness answers 503 with the reason, and the gateway refuses
new requests with 503 and Retry-After instead of holding them. One `Lifecycle` per
sidecar, kept by the `Manager` so that every part that already has it can read it.
"""

from __future__ import annotations

STARTING = "the start-up reconciliation of the engines is in progress"
STOPPING = "the sidecar is shutting down: it admits nothing new"


class Lifecycle:
    """`reason()` is None while serving, else why nothing new is admitted."""

    def __init__(self) -> None:
        self.starting = False
        self.stopping = False

    def reason(self) -> str | None:
        if self.stopping:
            return STOPPING
        if self.starting:
            return STARTING
        return None
