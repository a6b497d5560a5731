"""Device placement: which devices each model's engine runs on. Pure, like policy.py."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class Want:
    """What one model asks of placement: named devices, or a count of them (its TP size)."""

    name: str
    devices: tuple[str, ...] = ()
    count: int = 1


def place(wants: Sequence[Want], available: Sequence[str]) -> dict[str, tuple[str, ...]]:
    """Assign devices: a model that names its devices gets them; the others, in order, get
    `count` distinct devices among those with the fewest models placed so far (ties by the
    order of `available`). Raises ValueError with one clear line when a model cannot be
    placed (an unknown device, more devices than there are)."""
    avail = list(dict.fromkeys(available))
    load = {d: 0 for d in avail}
    out: dict[str, tuple[str, ...]] = {}
    for w in wants:
        if w.devices:
            unknown = [d for d in w.devices if d not in load]
            if unknown:
                raise ValueError(
                    f"model {w.name}: device(s) {', '.join(unknown)} not among "
                    f"swap.devices ({', '.join(avail)})"
                )
            if len(set(w.devices)) != len(w.devices):
                raise ValueError(f"model {w.name}: a device is named twice: {list(w.devices)}")
            for d in w.devices:
                load[d] += 1
            out[w.name] = tuple(w.devices)
    for w in wants:
        if w.devices:
            continue
        if w.count > len(avail):
            raise ValueError(
                f"model {w.name}: needs {w.count} devices, swap.devices has {len(avail)}"
            )
        order = sorted(avail, key=lambda d: (load[d], avail.index(d)))
        chosen = tuple(sorted(order[: w.count], key=avail.index))
        for d in chosen:
            load[d] += 1
        out[w.name] = chosen
    return {w.name: out[w.name] for w in wants}
