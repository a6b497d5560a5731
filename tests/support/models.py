"""Tiny seeded models: the one way tests make them (worker_ext.devmodels writes them)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

ModelFactory = Callable[..., Path]


def model_factory(root: Path) -> ModelFactory:
    """`make(arch="llama", seed=0, tokenizer=True) -> Path`: a seeded model folder under
    `root` with real safetensors (so a level-2 reload reproduces the weights), written once
    per factory."""
    made: dict[tuple[str, int, bool], Path] = {}

    def make(arch: str = "llama", seed: int = 0, tokenizer: bool = True) -> Path:
        key = (arch, seed, tokenizer)
        if key not in made:
            from worker_ext.devmodels import write_tiny_model

            name = f"tiny-{arch}-s{seed}{'-tok' if tokenizer else ''}"
            made[key] = write_tiny_model(root / name, arch=arch, seed=seed, tokenizer=tokenizer)
        return made[key]

    return make
