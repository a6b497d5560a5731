"""A record's part for what is known of the engine process itself: whether an RPC may have
left its reply queues out of step, the non-RPC sign of the process and the ranks' boot ids
last seen, the pools asleep (a partial wake) and the name it serves. Reconciliation
(controller.models.reconciler) writes most of it, the sequences the rest, each through a
method here that notifies; `memory()` is what the pure reconciliation reads."""

from __future__ import annotations

from controller.models.changes import Changes, Part
from controller.models.quarantine import Quarantine
from controller.models.reconcile import Memory, Verdict
from controller.state import State


class EngineFacts(Part):
    """What one model's engine process is known to be and hold."""

    desynced = False
    process_sign: str | None = None
    boot_ids: tuple[str | None, ...] | None = None
    asleep: tuple[str, ...] | None = None  # the pools asleep; None: all (or none, awake)
    served_model: str | None = None  # read from /v1/models when not configured
    model_class: str | None = None  # what the ranks' first verified probe reported
    # The sleep in force is vLLM's own (docs/contracts.md §2.3): "hotswap" through the
    # backend (the ranks moved, the wake verifies), "plain" (nothing verifies its wake);
    # None: no sleep, or the extension's.
    vllm_asleep: str | None = None

    def __init__(self, changes: Changes, served_model: str | None = None) -> None:
        super().__init__(changes)
        self.served_model = served_model
        self._quarantine = Quarantine(None)

    def keep_quarantine_in(self, quarantine: Quarantine) -> None:
        """Keep the quarantine (`desynced`) where a restarted sidecar finds it, and take
        back the one a sidecar before this one left: the process it is about gets no RPC
        until a new process answers."""
        self._quarantine = quarantine
        kept = quarantine.load()
        if kept is not None:
            self.desynced, self.process_sign, self.boot_ids = True, kept.process, kept.boot_ids
            self._changed()

    def memory(
        self,
        state: State,
        verified: bool,
        fresh: bool = False,
        *,
        accept_unverified: bool = False,
        unverified: bool = False,
    ) -> Memory:
        return Memory(
            accept_unverified=accept_unverified,
            unverified=unverified,
            plain_asleep=self.vllm_asleep == "plain",
            state=state,
            verified=verified,
            desynced=self.desynced,
            process=self.process_sign,
            boot_ids=self.boot_ids,
            fresh=fresh,
            served=self.served_model,
            model=self.model_class,
        )

    def remember(self, v: Verdict) -> None:
        """What a reconciliation's verdict says to remember of the process."""
        was = self.desynced
        self.desynced = v.desynced
        self.process_sign = v.process
        self.boot_ids = v.boot_ids
        if v.desynced and not was:
            self._quarantine.keep(self.process_sign, self.boot_ids)
        elif was and not v.desynced:
            self._quarantine.lift()  # a new process answers
        # The engine's identity, as first verified (a configured served name stays).
        if v.model is not None and self.model_class is None:
            self.model_class = v.model
        if v.served is not None and self.served_model is None:
            self.served_model = v.served
        if v.rule in ("suspended", "asleep-accepted"):  # read from the ranks
            self.asleep = v.tags or None
            self.vllm_asleep = v.vllm_asleep
        elif v.state in (State.RUNNING, State.RESUMING):
            self.asleep, self.vllm_asleep = None, None
        self._changed()

    def new_process(self) -> None:
        """The sidecar starts a process itself: nothing an RPC to the old one left out of
        step concerns it, nor anything seen of the old one."""
        self.desynced, self.process_sign, self.boot_ids, self.asleep = False, None, None, None
        self.vllm_asleep = None
        self._quarantine.lift()
        self._changed()

    def desync(self) -> None:
        """An RPC may have left the reply queues out of step: send this process nothing."""
        self.desynced = True
        self._quarantine.keep(self.process_sign, self.boot_ids)
        self._changed()

    def all_pools_moved(self) -> None:
        """A sleep released every pool its level releases, or a wake brought all back."""
        self.asleep = None
        self._changed()

    def slept_through_vllm(self, kind: str | None) -> None:
        """A sleep ended: vLLM's own ("hotswap" or "plain"), or the extension's (None)."""
        self.vllm_asleep = kind
        self._changed()

    def learn_served_model(self, name: str) -> None:
        self.served_model = name
        self._changed()
