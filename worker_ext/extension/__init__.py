"""HotSwapExtension: the hotswap_* RPC methods vLLM mixes into every worker, in parts: the
RPC wrapper (rpc), the rank's state and backend (base), the sleep's RPCs (sleeping), the
wake's (waking), the host-memory ones (hostmem), and the class that joins them (hotswap)."""

from worker_ext import graphpool as _graphpool
from worker_ext.extension.base import HotswapState as _HotswapState
from worker_ext.extension.hotswap import HotSwapExtension
from worker_ext.extension.rpc import plain, rpc
from worker_ext.pools import KV_CACHE

__all__ = ["KV_CACHE", "HotSwapExtension", "_HotswapState", "plain", "rpc"]

# Imported into a worker before its model loads (vLLM resolves the extension class first):
# vLLM's CUDA graphs then go to a CuMem pool the sleep releases (docs/contracts.md §1.2).
_graphpool.install()
