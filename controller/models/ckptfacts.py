"""A record's part for the deep sleep (docs/contracts.md §2.2): whether its engine can be
checkpointed by the driver and which of its processes hold a CUDA context. Written by the
deep sleep (controller.models.deepsleep) and the coordinator, through methods that notify."""

from __future__ import annotations

from controller.models.changes import Changes, Part


class CheckpointFacts(Part):
    def __init__(self, changes: Changes) -> None:
        super().__init__(changes)
        # None: not known yet; False: refused or failed (`refused` says why); True: probed.
        self.deepable: bool | None = None
        self.refused: str | None = None
        # The processes found holding a CUDA context, and the process group they were
        # found in (a new engine process is probed afresh).
        self.cuda_pids: tuple[int, ...] = ()
        self.group: int | None = None

    def capable(self, cuda_pids: tuple[int, ...], group: int) -> None:
        self.deepable, self.refused = True, None
        self.found(cuda_pids, group)

    def found(self, cuda_pids: tuple[int, ...], group: int) -> None:
        self.cuda_pids, self.group = cuda_pids, group
        self._changed()

    def unable(self, why: str | None) -> None:
        self.deepable, self.refused = False, why
        self._changed()

    def knows(self, group: int, pids: tuple[int, ...]) -> bool:
        """A positive probe of this process group whose CUDA processes all still live."""
        ok = self.deepable is True and self.cuda_pids and self.group == group
        return bool(ok) and set(self.cuda_pids) <= set(pids)
