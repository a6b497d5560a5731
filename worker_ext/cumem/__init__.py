"""CUDA pool backend on vLLM's CuMemAllocator (engine started with --enable-sleep-mode).

Pools are the allocator's tags: every `pointer_to_data` record is one cuMem segment with
its tag (`weights` while the model loads, `kv_cache` while the KV cache is set up). The
backend releases and re-maps records itself, per record, because vLLM 0.26's
`CuMemAllocator.sleep` cannot release one tag alone and its `wake_up` does not check
`is_asleep`: it releases with vLLM's `unmap_and_release` and maps with the same driver calls
as vLLM's `create_and_map`, made through ctypes (worker_ext/cudriver.py): vLLM's call asks
for fabric-exportable memory on every record and, where the driver refuses, asks again
with a POSIX fd for every record; cudriver asks once, gets the same memory, and times each
call. Each record's `is_asleep` is kept truthful. Do not mix this backend with vLLM's own
/sleep and /wake_up on one engine.

The fast path (why it is faster than vLLM's sleep/wake, which copy one record at a time
with a synchronous cudaMemcpy into a power-of-two rounded pinned tensor per record):

- one host buffer of exactly the weights' bytes, one slice per record, so host RAM held by
  a sleeping model is its weights and nothing more (`hostbuf`), made ahead of time in a
  background thread when the backend is created, or at the first level-1 suspend;
- the weights' copy coded on the GPU (`coded`, worker_ext/codec.py), unless the host codec
  is off;
- copies of at most CHUNK_BYTES on two streams, never crossing a registration (`streams`);
  suspend releases each record as soon as its copies are done (`suspend`); resume maps
  each record and queues its copies at once, so mapping overlaps the transfer (`resume`);
- resume returns with the copies ordered before any later work on the worker's current
  stream (no host wait); `synchronize()` waits for them, and every later backend call does
  so first: mapping the KV pool during the weights' copy slows the copy down;
- resume reports its steps in `timings` (map and queue per tag with the thread's CPU time
  and the time in each driver call; the host wait for earlier copies, their GPU time from
  CUDA events, vLLM's side effects).

A level-1 sleep that keeps the KV cache (the prefix cache across a sleep, docs/contracts.md
§1.3) offloads the `kv_cache` pool the same way into a second pinned buffer of exactly the
KV pool's bytes, made in the background at the first prepare that asks for it. A level-2
sleep can leave the weights' coded bytes in the disk tier for its wake (`tier`).

Every suspend ends by giving torch's cached free blocks back (gc + empty_cache, as vLLM's
own sleep does): what stays on the device is reported by `resident()` (hotswap_info,
`resident`). After a wake the host buffers are kept for the next sleep unless
HOTSWAP_KEEP_HOST_BACKUP=0. The backend also compiles and proves verify's Triton check when
it is made (fpkernel.warm), so that the first sleep's prepare does not pay the compile.
Measured effects of each choice: docs/benchmarks.md.
"""

from worker_ext.cumem.backend import CuMemBackend

__all__ = ["CuMemBackend"]
