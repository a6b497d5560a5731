"""A record's part for the bytes its engine holds where (device, host), as measured: what
the swap and host policies plan with. Written by the sequences (a sleep's and a wake's
reports), reconciliation (what the ranks say they keep), the coordinator (measured
footprints) and the host budget's actions, each through a method here that notifies."""

from __future__ import annotations

from collections.abc import Mapping

from controller.models.changes import Changes, Part


class Holdings(Part):
    """Measured bytes of one model's engine; `footprint` is never overwritten once configured."""

    def __init__(self, changes: Changes, footprint: int | None = None) -> None:
        super().__init__(changes)
        # Awake footprint in bytes: configured (never overwritten) or measured.
        self.footprint = footprint
        self.footprint_configured = footprint is not None
        # Bytes by pool (weights, kv_cache) over every rank, as last measured (hotswap_info
        # at start, the bytes a sleep freed): what an overlapped swap plans with.
        self.pools: dict[str, int] = {}
        # Weights bytes the last sleep copied off the device (freed and offloaded, over
        # ranks): 0 where a sleep copies nothing (the host backend, level 2); None: no
        # sleep seen yet. An overlapped swap only pays off when this is not 0.
        self.copied_bytes: int | None = None
        # What its engine held on its devices after its last suspend (the snapshot's
        # resident_bytes, kept while awake; 0 until one is reported), and in host RAM now (a
        # level-1 sleeper's weights, an awake model's kept backup); what a level-1 sleep
        # holds there.
        self.asleep_bytes = 0
        self.host_bytes = 0
        self.host_weights: int | None = None
        self.demotable = True  # its backend can drop a level-1 host copy while asleep
        # Device bytes its next wake takes for a while beyond its footprint (the codec's
        # staging, as its last suspend reported; 0 awake): the policy adds it to the need.
        self.wake_scratch = 0
        # The largest such figure it ever reported: its coder's staging, which its own
        # sleep holds while it encodes (an overlapped swap's peak counts it).
        self.codec_scratch = 0

    def learn_footprint(self, n: int | None) -> bool:
        """A measured awake footprint; True when it changed (a configured one never does)."""
        if n is None or self.footprint_configured or self.footprint == n:
            return False
        self.footprint = n
        self._changed()
        return True

    def learn_pools(self, pools: Mapping[str, int]) -> dict[str, int] | None:
        """The pools' measured bytes (nothing measured: kept as they were); the pools now
        when that changed them, else None."""
        known = {**self.pools, **{k: int(v) for k, v in pools.items() if v > 0}}
        if known == self.pools:
            return None
        self.pools = known
        self._changed()
        return known

    def learn_wake_scratch(self, nbytes: int) -> None:
        """What its next wake decodes through, as a suspend (or a rank read back) said; the
        largest such figure is kept as its coder's staging."""
        self.wake_scratch = nbytes
        self.codec_scratch = max(self.codec_scratch, nbytes)
        self._changed()

    def slept(self, copied_bytes: int, wake_scratch: int) -> None:
        """A finished sleep: the weights it copied off the device, its next wake's scratch."""
        self.copied_bytes = copied_bytes
        self.learn_wake_scratch(wake_scratch)

    def woke(self, leftover_bytes: int) -> None:
        """A finished wake: no scratch; what it held asleep it holds awake too (beside its
        pools), kept for the policy also when no sleep of ours measured it."""
        self.wake_scratch = 0
        self.asleep_bytes = leftover_bytes
        self._changed()

    def left_on_device(self, nbytes: int) -> None:
        """What its last suspend's ranks said they left on their devices."""
        self.asleep_bytes = nbytes
        self._changed()

    def hold_host(self, nbytes: int) -> None:
        """The host bytes it holds now (a sleep's copy, a wake's kept backup, as said)."""
        self.host_bytes = nbytes
        self._changed()

    def release_host(self) -> int:
        """Its host copy or backup was released; returns the bytes that were counted."""
        freed, self.host_bytes = self.host_bytes, 0
        self._changed()
        return freed

    def hold_host_weights(self, nbytes: int) -> None:
        """A level-1 sleep's host bytes: what its next level-1 sleep holds."""
        self.host_weights = nbytes
        self._changed()

    def set_demotable(self, demotable: bool) -> None:
        """Whether its level-1 host copy can be dropped (a sleep's prepare said, or every
        rank refused a demotion: not until the next sleep)."""
        self.demotable = demotable
        self._changed()
