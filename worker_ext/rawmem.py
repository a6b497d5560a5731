"""Raw byte views of device or host memory at an address, for the fingerprints and the
protection by range (the caller keeps that memory alive; the view owns nothing)."""

from __future__ import annotations

import ctypes
from typing import Any

import torch

__all__ = ["raw_bytes"]


class _CudaRange:
    """`__cuda_array_interface__` of `n` bytes at device address `ptr` (for torch.as_tensor)."""

    def __init__(self, ptr: int, n: int) -> None:
        self.__cuda_array_interface__ = {
            "shape": (n,),
            "typestr": "|u1",
            "strides": None,
            "data": (ptr, False),
            "version": 2,
        }


def raw_bytes(ptr: int, n: int, device: Any) -> Any:
    """A uint8 tensor over [ptr, ptr + n) on `device`; the caller keeps that memory alive."""
    if device.type == "cuda":
        out = torch.as_tensor(_CudaRange(ptr, n), device=device)
    elif device.type == "cpu":
        out = torch.frombuffer((ctypes.c_uint8 * n).from_address(ptr), dtype=torch.uint8)
    else:
        raise ValueError(f"no raw view on {device}")
    if int(out.data_ptr()) != ptr or int(out.numel()) != n or out.device != device:
        raise RuntimeError(f"raw view of {n} bytes at {ptr:#x} on {device} came out wrong")
    return out
