"""Which tensor lives in which pool, and which of them a sleep level would lose.

The walk covers every tensor reachable from the model (parameters, registered buffers,
plain tensor attributes of every module, tensors inside lists/dicts/tuples that modules
hold) and the model runner's persistent tensors (its `__dict__` and nested plain objects
and containers, to a bounded depth). Aliases (tensors on one storage) collapse into one
record that keeps the first readable name and every slot that refers to it, so a later
rebind can put the original tensor back into each slot.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch

from worker_ext.pools import GRAPHS, KV_CACHE, UNPOOLED, WEIGHTS, policy

PARAMETER = "parameter"
BUFFER = "buffer"
ATTRIBUTE = "attribute"
RUNNER = "runner"

# Slot kinds: how to read/write the tensor back on its owner.
SLOT_PARAM = "param"  # owner._parameters[key]
SLOT_BUFFER = "buffer"  # owner._buffers[key]
SLOT_ATTR = "attr"  # owner.__dict__[key]
SLOT_ITEM = "item"  # owner[key] (list or dict)

RUNNER_MAX_DEPTH = 6  # runner > input_batch > block_table > block_tables > BlockTable > buffer
CONTAINER_MAX_DEPTH = 2
CONTAINER_MAX_ITEMS = (
    512  # runner dicts keyed by request can be long; they hold no persistent state
)
# Runner attributes that are not the runner's own tensors: the model (walked as the model),
# the KV cache (named first, below) and config/registry objects that only hold settings.
RUNNER_SKIP = frozenset({"model", "kv_caches", "vllm_config", "mm_registry", "requests"})


@dataclass
class Slot:
    owner: Any
    kind: str
    key: str | int

    def get(self) -> Any:
        if self.kind == SLOT_PARAM:
            return self.owner._parameters.get(self.key)
        if self.kind == SLOT_BUFFER:
            return self.owner._buffers.get(self.key)
        if self.kind == SLOT_ATTR:
            return vars(self.owner).get(str(self.key))
        try:
            return self.owner[self.key]
        except (KeyError, IndexError, TypeError):
            return None

    def set(self, value: Any) -> None:
        if self.kind == SLOT_PARAM:
            self.owner._parameters[self.key] = value
        elif self.kind == SLOT_BUFFER:
            self.owner._buffers[self.key] = value
        elif self.kind == SLOT_ATTR:
            vars(self.owner)[str(self.key)] = value
        else:
            self.owner[self.key] = value


@dataclass
class TensorRecord:
    name: str
    tensor: Any  # torch.Tensor; the first tensor seen on this storage
    kind: str
    is_kv: bool = False
    slots: list[Slot] = field(default_factory=list)

    @property
    def nbytes(self) -> int:
        return int(self.tensor.untyped_storage().nbytes())


def storage_key(t: Any) -> int:
    """Identity of a tensor's storage that survives resizing it (data_ptr does not)."""
    return int(t.untyped_storage()._cdata)


def kv_tensors(runner: Any) -> list[Any]:
    """The KV cache tensors the runner holds (flattening nested lists)."""
    out: list[Any] = []

    def add(x: Any) -> None:
        if isinstance(x, torch.Tensor):
            out.append(x)
        elif isinstance(x, (list, tuple)):
            for y in x:
                add(y)
        elif isinstance(x, dict):
            for y in x.values():
                add(y)

    add(getattr(runner, "kv_caches", None))
    return out


class _Collector:
    def __init__(self) -> None:
        self.records: list[TensorRecord] = []
        self.by_storage: dict[int, TensorRecord] = {}
        self.seen_objects: set[int] = set()

    def add(self, name: str, t: Any, kind: str, slot: Slot | None, is_kv: bool = False) -> None:
        if t.is_meta:
            return
        key = storage_key(t)
        rec = self.by_storage.get(key)
        if rec is None:
            rec = TensorRecord(name=name, tensor=t, kind=kind, is_kv=is_kv)
            self.by_storage[key] = rec
            self.records.append(rec)
        if slot is not None:
            rec.slots.append(slot)

    def container(self, name: str, obj: Any, kind: str, depth: int, objects: bool = False) -> None:
        """Tensors inside lists/tuples/dicts, to `depth` levels; with `objects` (the runner's
        containers) also the plain objects inside them."""
        if depth < 0 or id(obj) in self.seen_objects:
            return
        self.seen_objects.add(id(obj))
        items: Iterator[tuple[str | int, Any]]
        items = iter(obj.items()) if isinstance(obj, dict) else iter(enumerate(obj))
        for n, (k, v) in enumerate(items):
            if n >= CONTAINER_MAX_ITEMS:
                break
            # Tuples are immutable: their tensors are recorded without a writable slot.
            slot = None if isinstance(obj, tuple) else Slot(obj, SLOT_ITEM, k)
            if isinstance(v, torch.Tensor):
                self.add(f"{name}.{k}", v, kind, slot)
            elif isinstance(v, (list, tuple, dict)):
                self.container(f"{name}.{k}", v, kind, depth - 1, objects)
            elif objects and _walkable(v):
                self.plain(f"{name}.{k}", v, depth - 1)

    def module(self, prefix: str, model: Any) -> None:
        """Parameters first, then buffers, then attributes: an alias keeps the better name."""
        mods = []
        for mname, mod in model.named_modules(remove_duplicate=True):
            if id(mod) not in self.seen_objects:
                self.seen_objects.add(id(mod))
                mods.append((".".join(x for x in (prefix, mname) if x), mod))
        for base, mod in mods:
            for k, p in mod._parameters.items():
                if p is not None:
                    self.add(_join(base, k), p, PARAMETER, Slot(mod, SLOT_PARAM, k))
        for base, mod in mods:
            for k, b in mod._buffers.items():
                if b is not None:
                    self.add(_join(base, k), b, BUFFER, Slot(mod, SLOT_BUFFER, k))
        for base, mod in mods:
            for k, v in vars(mod).items():
                if k in ("_parameters", "_buffers", "_modules") or k.startswith("_forward"):
                    continue
                if isinstance(v, torch.Tensor):
                    self.add(_join(base, k), v, ATTRIBUTE, Slot(mod, SLOT_ATTR, k))
                elif isinstance(v, (list, tuple, dict)):
                    self.container(_join(base, k), v, ATTRIBUTE, CONTAINER_MAX_DEPTH)

    def plain(self, name: str, obj: Any, depth: int) -> None:
        """The runner and the plain objects it holds: tensors, containers, nested objects."""
        if depth < 0 or id(obj) in self.seen_objects:
            return
        if isinstance(obj, torch.nn.Module):
            self.module(name, obj)
            return
        self.seen_objects.add(id(obj))
        try:
            attrs = vars(obj)
        except TypeError:
            return
        for k, v in list(attrs.items())[:CONTAINER_MAX_ITEMS]:
            if depth == RUNNER_MAX_DEPTH and k in RUNNER_SKIP:
                continue
            child = f"{name}.{k}"
            if isinstance(v, torch.Tensor):
                self.add(child, v, RUNNER, Slot(obj, SLOT_ATTR, k))
            elif isinstance(v, (list, tuple, dict)):
                self.container(child, v, RUNNER, depth - 1, objects=True)
            elif _walkable(v):
                self.plain(child, v, depth - 1)


def _join(base: str, key: str | int) -> str:
    return f"{base}.{key}" if base else str(key)


_SCALARS = (str, bytes, int, float, bool, type(None), torch.dtype, torch.device)


def _walkable(v: Any) -> bool:
    """Plain Python objects whose attributes may hold tensors (not classes, functions, configs)."""
    if isinstance(v, (*_SCALARS, type)) or inspect.isroutine(v):
        return False
    mod = type(v).__module__ or ""
    if mod.startswith(("numpy", "threading", "_thread", "builtins", "torch.cuda", "collections")):
        return False
    return hasattr(v, "__dict__") and not type(v).__name__.endswith("Config")


def walk(model: Any, runner: Any | None) -> list[TensorRecord]:
    """Every tensor the worker keeps, deduplicated by storage; KV first, then model, runner."""
    c = _Collector()
    if runner is not None:
        for i, t in enumerate(kv_tensors(runner)):
            c.add(f"runner.kv_caches.{i}", t, RUNNER, Slot(runner.kv_caches, SLOT_ITEM, i), True)
    if model is not None:
        c.module("", model)  # the model's own names: model.layers.0..., lm_head.weight
    if runner is not None:
        c.seen_objects.add(id(model))
        c.plain("runner", runner, RUNNER_MAX_DEPTH)
    return c.records


def restored_by(level: int, pool: str, kind: str) -> bool:
    """Whether the level's own mechanism brings these bytes back."""
    if pool == WEIGHTS:
        # Level 1 offloads the whole pool; level 2 gets back only what the reload refills.
        return level == 1 or kind == PARAMETER
    if pool == GRAPHS:
        return False  # mapped back empty: a tensor someone holds there is protected
    # The KV cache is discarded; pools the level does not discard keep their bytes.
    return pool != KV_CACHE


def judge(
    records: list[TensorRecord], level: int, tag_of: Callable[[int, int], str]
) -> list[dict[str, Any]]:
    """The audit table: one row per record, in walk order."""
    rows: list[dict[str, Any]] = []
    for r in records:
        nbytes = r.nbytes
        pool = tag_of(r.tensor.untyped_storage().data_ptr(), nbytes) if nbytes else UNPOOLED
        restored = restored_by(level, pool, r.kind)
        discarded = pool in (WEIGHTS, KV_CACHE, GRAPHS) and policy(level, pool) == "discarded"
        rows.append(
            {
                "name": r.name,
                "bytes": nbytes,
                "kind": r.kind,
                "pool": pool,
                "restored": restored,
                "at_risk": bool(discarded and not restored and not r.is_kv),
                "kv": r.is_kv,
            }
        )
    return rows
