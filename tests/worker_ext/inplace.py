"""In-place pools on host memory and a worker over them: the extension end to end with no
engine and no GPU (test_demote_in_place, test_fused_sleep).

One host buffer stands in for the device: a weights record (two parameters, a buffer and
bytes no tensor names, as a module global would hold) and a kv_cache record (the KV cache
and a block table). A suspend fills a discarded record with junk (its memory is gone); a
level-1 suspend keeps a host copy of the weights record and the resume copies it back.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import torch

from worker_ext import ranges
from worker_ext.extension import HotSwapExtension, _HotswapState
from worker_ext.pools import DISCARDED, KV_CACHE, OFFLOADED, UNPOOLED, WEIGHTS, policy
from worker_ext.rawmem import raw_bytes
from worker_ext.settings import WorkerSettings

KIB = 1024
CPU = torch.device("cpu")
JUNK = 0xA5


class InPlacePools:
    """A PoolBackend over one host buffer whose records come back at the same addresses."""

    name = "in-place"
    in_place = True

    def __init__(self, buf: torch.Tensor, records: list[tuple[int, int, str]]) -> None:
        self.buf, self.base = buf, int(buf.data_ptr())
        self._records = records
        self.device = CPU
        self.settings = WorkerSettings()
        self._asleep: dict[str, str] = {}
        self._level: int | None = None
        self.host: dict[str, torch.Tensor] = {}  # the level-1 copies (CUDA: pinned)

    def _view(self, tag: str) -> torch.Tensor:
        (s, e) = next((s, e) for s, e, t in self._records if t == tag)
        return self.buf[s - self.base : e - self.base]

    def records(self) -> list[tuple[int, int, str]]:
        return list(self._records)

    def free_ranges(self) -> list[tuple[int, int]]:
        return []

    def pools(self) -> dict[str, int]:
        return {t: e - s for s, e, t in self._records}

    def tag_of(self, data_ptr: int, nbytes: int) -> str:
        return ranges.owner(self._records, data_ptr) or UNPOOLED

    def suspended(self) -> dict[str, str]:
        return dict(self._asleep)

    def memory(self) -> dict[str, int]:
        return {"rss": 0}

    def refresh(self) -> None:
        pass

    def resident(self) -> dict[str, Any]:
        return {"bytes": 0, "source": "none"}

    def release_cached(self) -> float:
        return 0.0

    def host_backup_bytes(self) -> int:
        return sum(int(t.numel()) for t in self.host.values())

    def drop_backup(self) -> dict[str, int]:
        freed = {t: int(b.numel()) for t, b in self.host.items()}
        self.host.clear()
        return freed

    def wake_scratch_bytes(self) -> int:
        return 0

    def describe(self) -> dict[str, Any]:
        return {}

    def after_reload(self) -> list[str]:
        return []

    def unready(self) -> list[str]:
        return []

    def tier_restored(self) -> dict[str, Any] | None:
        return None

    def prepare_kv_keep(self) -> None:
        pass

    def kv_keep_refusal(self) -> str | None:
        return "not kept here"

    def suspend(
        self,
        level: int,
        tags: list[str],
        keep_kv: bool = False,
        rewritten: Sequence[tuple[int, int]] = (),
    ) -> dict[str, Any]:
        freed, offloaded = {}, {}
        for tag in tags:
            how = policy(level, tag, keep_kv)
            view = self._view(tag)
            if how == OFFLOADED:
                self.host[tag] = view.clone()
            view.fill_(JUNK)  # the device memory is released
            freed[tag] = int(view.numel())
            offloaded[tag] = freed[tag] if how == OFFLOADED else 0
            self._asleep[tag] = how
        self._level = level
        return {"freed_bytes": freed, "offloaded_bytes": offloaded}

    def resume(self, tags: list[str]) -> dict[str, Any]:
        restored = {}
        for tag in tags:
            how = self._asleep.pop(tag)
            view = self._view(tag)
            if how == OFFLOADED:
                view.copy_(self.host[tag])  # the copy is kept for the next sleep
            restored[tag] = int(view.numel())
        return {"restored_bytes": restored}

    def demote_refusal(self) -> str | None:  # as worker_ext.cumem's
        if self._level != 1 or self._asleep.get(WEIGHTS) != OFFLOADED:
            return f"demote: the weights are not offloaded at level 1 ({self._asleep})"
        return None

    def demote(self) -> dict[str, Any]:
        freed = {WEIGHTS: int(self.host.pop(WEIGHTS).numel()), KV_CACHE: 0}
        self._asleep[WEIGHTS] = DISCARDED
        self._level = 2
        return {"freed_bytes": {WEIGHTS: freed[WEIGHTS]}, "freed_host_bytes": freed}


class _Model(torch.nn.Module):
    def __init__(self, at: Any) -> None:
        super().__init__()
        self.w1 = torch.nn.Parameter(at(0, 4096).view(torch.float32), requires_grad=False)
        self.w2 = torch.nn.Parameter(at(8192, 2048).view(torch.float32), requires_grad=False)
        self.register_buffer("scale", at(12288, 256).view(torch.float32))

    def forward(self) -> torch.Tensor:
        return self.w1.sum() + self.w2.sum() + self.scale.sum()


class _Runner:
    def __init__(self, model: torch.nn.Module, at: Any) -> None:
        self.model = model
        self.kv_caches = [at(32 * KIB, 16 * KIB)]
        self.block_table = at(50000, 128).view(torch.int32)

    def get_model(self) -> torch.nn.Module:
        return self.model


class Worker(HotSwapExtension):
    """The Worker's part the extension reads: model_runner, rank, reload_weights."""

    rank = 0
    parallel_config = None  # one rank: hotswap_info's world size falls back to 1

    def __init__(self, demotable: bool = True) -> None:
        self.buf = torch.randint(0, 256, (64 * KIB,), dtype=torch.uint8)
        base = int(self.buf.data_ptr())
        records = [(base, base + 32 * KIB, WEIGHTS), (base + 32 * KIB, base + 64 * KIB, KV_CACHE)]
        self.pools = InPlacePools(self.buf, records)
        model = _Model(lambda off, n: raw_bytes(base + off, n, CPU))
        self.model_runner = _Runner(model, lambda off, n: raw_bytes(base + off, n, CPU))
        self.checkpoint = {n: p.detach().clone() for n, p in model.named_parameters()}
        self.reloads = 0
        self.global_w = (20000, 20512)  # bytes of the weights record no tensor names
        settings = dataclasses.replace(WorkerSettings(), demotable=demotable, warm_prepare=False)
        self.pools.settings = settings
        self._hotswap_st = _HotswapState(settings, self.pools)

    def reload_weights(self) -> None:
        """vLLM's reload: the parameters from the checkpoint, nothing else."""
        self.reloads += 1
        for n, p in self.model_runner.model.named_parameters():
            p.data.copy_(self.checkpoint[n])

    def weights_bytes(self) -> torch.Tensor:
        return self.buf[: 32 * KIB].clone()

    def sleep(self, level: int) -> dict[str, Any]:
        for step in ("hotswap_prepare", "hotswap_suspend"):
            out = getattr(self, step)(level)
            assert out["ok"], out
        return out

    def wake(self, level: int) -> dict[str, Any]:
        assert self.hotswap_resume([WEIGHTS])["ok"]
        if level == 2:
            assert self.hotswap_reload()["ok"]
        assert self.hotswap_resume([KV_CACHE])["ok"]
        out: dict[str, Any] = self.hotswap_restore_and_verify()
        return out
