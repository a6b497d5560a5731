"""hotswap_demote on a backend that maps its pools back in place (CUDA's shape), end to end
through the extension on host memory (no engine, no GPU).

Over inplace.py's pools (one host buffer standing in for the device, a level-1 suspend
keeping a host copy of the weights record): a demotion must release that copy, and the
level-2 wake that follows (resume, reload of the parameters only, restore and verify) must
bring back every byte: docs/contracts.md §1.
"""

from __future__ import annotations

from typing import Any

import torch
from inplace import KIB, Worker

from worker_ext.pools import DISCARDED, KV_CACHE, WEIGHTS


def _truth(w: Worker) -> dict[str, Any]:
    info = w.hotswap_info()
    return {k: info[k] for k in ("phase", "phase_level", "transitions", "level")}


def test_a_level1_sleeper_demoted_wakes_through_the_reload_with_every_byte_back() -> None:
    w = Worker()
    before = w.weights_bytes()
    prep = w.hotswap_prepare(1)
    assert prep["ok"], prep
    assert prep["demotable"] is True
    assert prep["pools"][WEIGHTS]["discarded"] == 1  # level 2's ranges, planned now
    assert w.hotswap_suspend(1)["ok"]
    assert w.hotswap_info()["host_backup_bytes"] == 32 * KIB
    d = w.hotswap_demote()
    assert d["ok"], d
    assert d["level"] == 2
    assert d["freed_host_bytes"][WEIGHTS] == 32 * KIB
    assert d["host_backup_bytes"] == 0
    assert d["protected_bytes"] > 512  # the buffer, the unnamed global, the gaps
    truth = _truth(w)
    assert (truth["phase"], truth["phase_level"], truth["level"]) == ("suspended", 2, 2)
    assert w.hotswap_info()["suspended"] == {WEIGHTS: DISCARDED, KV_CACHE: DISCARDED}
    refused = w.hotswap_wake()  # level 2: the weights need their reload first
    assert refused["ok"] is False
    v = w.wake(2)
    assert v["ok"], v
    assert v["verified"] == prep["fingerprinted"]
    assert w.reloads == 1
    assert torch.equal(w.weights_bytes(), before)  # parameters, buffer and the unnamed bytes
    assert w.hotswap_info()["phase"] == "awake_verified"


def test_a_reload_that_brings_other_parameters_fails_the_wake() -> None:
    w = Worker()
    w.sleep(1)
    assert w.hotswap_demote()["ok"]
    w.checkpoint["w2"].view(torch.uint8)[3] ^= 1  # the checkpoint is not what was asleep
    v = w.wake(2)
    assert v["ok"] is False
    assert v["mismatched"] == ["w2"], v
    assert w.hotswap_info()["phase"] == "failed"


def test_a_level1_wake_with_the_level2_protection_still_verifies() -> None:
    w = Worker()
    before = w.weights_bytes()
    w.sleep(1)
    v = w.wake(1)
    assert v["ok"], v
    assert w.reloads == 0
    assert torch.equal(w.weights_bytes(), before)


def test_without_the_level2_protection_a_demotion_is_refused_untouched() -> None:
    w = Worker(demotable=False)
    prep = w.hotswap_prepare(1)
    assert prep["demotable"] is False
    assert prep["pools"][WEIGHTS]["discarded"] == 0
    assert w.hotswap_suspend(1)["ok"]
    truth = _truth(w)
    d = w.hotswap_demote()
    assert d["ok"] is False
    assert "HOTSWAP_DEMOTABLE" in d["error"]
    assert _truth(w) == truth  # neither phase nor transitions moved
    assert w.hotswap_info()["host_backup_bytes"] == 32 * KIB  # the copy is still held
    assert w.wake(1)["ok"]


def test_a_demotion_while_awake_or_at_level_2_is_refused() -> None:
    w = Worker()
    truth = _truth(w)
    awake = w.hotswap_demote()
    assert awake["ok"] is False
    assert "not asleep at level 1" in awake["error"]
    assert _truth(w) == truth
    w.sleep(2)
    truth = _truth(w)
    assert w.hotswap_demote()["ok"] is False
    assert _truth(w) == truth
    assert w.wake(2)["ok"]
