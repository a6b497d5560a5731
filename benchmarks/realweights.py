"""Weights drawn like a trained model's, for the codec's benchmarks.

vLLM's dummy loader draws uniform values in a fixed small interval, whose exponents are
not like a trained checkpoint's. Here every tensor gets its own normal distribution with a
scale drawn log-uniformly from the range trained linear layers show (std 0.005-0.06), 0.1%
of its values multiplied by 20 (the outliers trained models have), and norm weights drawn
around 1 (per-tensor mean 0.1-1.5, spread 5%). Deterministic for a seed.
"""

from __future__ import annotations

import math
from typing import Any

STD_RANGE = (0.005, 0.06)
OUTLIER_FRACTION = 1e-3
OUTLIER_SCALE = 20.0


def fill_(t: Any, name: str, seed: int) -> dict[str, float]:
    """Overwrite floating tensor `t` in place; returns the parameters drawn."""
    import torch

    g = torch.Generator(device="cpu").manual_seed(seed)
    u = float(torch.rand((), generator=g))
    gd = torch.Generator(device=t.device).manual_seed(seed)
    flat = t.view(-1)
    if "norm" in name:
        mean = 0.1 + 1.4 * u
        flat.copy_(torch.randn(flat.shape, generator=gd, device=t.device) * (0.05 * mean) + mean)
        return {"mean": mean}
    lo, hi = (math.log(x) for x in STD_RANGE)
    std = math.exp(lo + (hi - lo) * u)
    vals = torch.randn(flat.shape, generator=gd, device=t.device, dtype=torch.float32) * std
    n_out = int(flat.numel() * OUTLIER_FRACTION)
    if n_out:
        idx = torch.randint(0, flat.numel(), (n_out,), generator=gd, device=t.device)
        vals[idx] *= OUTLIER_SCALE
    flat.copy_(vals.to(t.dtype))
    return {"std": std}


def fill_model_(named: Any, seed: int = 0) -> int:
    """Fill every floating parameter of `named` ((name, tensor) pairs); returns bytes."""
    import torch

    n = 0
    with torch.no_grad():
        for i, (name, p) in enumerate(named):
            if p.is_floating_point() and p.numel() and p.is_contiguous():
                fill_(p.data, name, seed * 100003 + i)
                n += p.numel() * p.element_size()
    return n
