"""Weights drawn like a trained model's, for the codec's benchmarks: the drawing lives in
worker_ext.devmodels (realistic_fill_, realistic_fill_model_), which the tests use too."""

from __future__ import annotations

from worker_ext.devmodels import realistic_fill_ as fill_
from worker_ext.devmodels import realistic_fill_model_ as fill_model_

__all__ = ["fill_", "fill_model_"]
