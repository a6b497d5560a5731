"""The quarantine of an engine whose reply queues may be out of step, kept on disk so that
a restarted sidecar finds it again.

After an RPC that timed out, broke its connection or answered 5xx, nothing may be sent to
that process until a sign learned without an RPC says a new process answers
(docs/contracts.md §2.1). That memory used to live in the sidecar's process only: a
restarted sidecar probed the quarantined engine with `hotswap_info` and could read another
call's reply. The file holds the process sign and boot ids the quarantine is about; it is
written when the quarantine begins and removed when a new process is seen.

Where (what survives a restart of the sidecar's container, not only of its process): in
`state_dir` when configured (an emptyDir lives as long as the pod), else beside an attached
engine's Unix socket (the folder both containers mount). A managed engine needs none: a
restarted sidecar starts its engines anew. An engine reached by URL without `state_dir`
keeps none (logged once at start).
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import tempfile
from dataclasses import dataclass
from pathlib import Path

from controller.config.modelsettings import ModelSettings

log = logging.getLogger("hotswap.reconcile")


@dataclass(frozen=True)
class Kept:
    """A quarantine read back: the process it is about."""

    process: str | None
    boot_ids: tuple[str | None, ...] | None


class Quarantine:
    """One model's quarantine file (`path` None: kept in memory only)."""

    def __init__(self, path: Path | None) -> None:
        self.path = path

    @classmethod
    def for_model(cls, m: ModelSettings, state_dir: Path | None) -> Quarantine:
        if m.managed:
            return cls(None)
        if state_dir is not None:
            return cls(state_dir / f"{m.name}.quarantine.json")
        if m.uds is not None:
            return cls(Path(m.uds).parent / f".{m.name}.hotswap-quarantine.json")
        log.info(
            "%s: no state_dir and no socket: a quarantine would not survive a restart",
            m.name,
            extra={"model": m.name, "phase": "reconcile", "rank": None},
        )
        return cls(None)

    def load(self) -> Kept | None:
        """The quarantine a sidecar before this one left, if any (an unreadable file counts
        as one about an unknown process: nothing is sent until a new process is seen)."""
        if self.path is None:
            return None
        try:
            data = json.loads(self.path.read_text(encoding="utf-8"))
        except FileNotFoundError:
            return None
        except (OSError, ValueError):
            return Kept(process=None, boot_ids=None)
        process = data.get("process") if isinstance(data, dict) else None
        boots = data.get("boot_ids") if isinstance(data, dict) else None
        return Kept(
            process=process if isinstance(process, str) else None,
            boot_ids=tuple(boots) if isinstance(boots, list) else None,
        )

    def keep(self, process: str | None, boot_ids: tuple[str | None, ...] | None) -> None:
        """Write it (atomically: a temporary file renamed over it, mode 0600)."""
        if self.path is None:
            return
        body = json.dumps({"process": process, "boot_ids": list(boot_ids or ()) or None})
        try:
            fd, tmp = tempfile.mkstemp(prefix=".quarantine-", dir=self.path.parent)
            with os.fdopen(fd, "w", encoding="utf-8") as f:
                f.write(body)
            os.replace(tmp, self.path)
        except OSError as exc:
            log.warning("could not keep the quarantine in %s: %s", self.path, exc)

    def lift(self) -> None:
        if self.path is not None:
            with contextlib.suppress(FileNotFoundError):
                self.path.unlink()
