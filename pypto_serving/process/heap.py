"""How a process's glibc heap keeps or returns freed memory: the API process returns big freed
blocks (request bodies); the cpu backend's worker keeps a step's activations for the next."""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import gc

M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3  # glibc mallopt parameters
MMAP_THRESHOLD_MAX = 32 << 20  # glibc refuses more on 64-bit
# The API process's cyclic collector once it serves: the youngest generation is collected
# every 10,000 net allocations (Python's default: 700), the older ones half as often.
SERVING_GC_THRESHOLDS = (10_000, 20, 20)


@functools.cache
def _glibc() -> ctypes.CDLL | None:
    name = ctypes.util.find_library("c")
    libc = ctypes.CDLL(name) if name else None
    return libc if libc is not None and hasattr(libc, "mallopt") and hasattr(libc, "malloc_trim") else None


def release_freed_memory() -> None:
    """Makes glibc give large freed blocks back to the OS (the API process for good: a
    megabyte request body must not stay resident after its request; the worker while it loads).

    Loading dequantizes and packs tensor after tensor; glibc's dynamic mmap threshold would
    keep those freed megabytes in the heap, and the worker's resident memory would stay
    hundreds of MiB above its weights and KV cache for good.
    """
    if libc := _glibc():
        libc.mallopt(M_MMAP_THRESHOLD, 1 << 20)  # allocations over 1 MiB get their own mapping


def reuse_freed_memory() -> None:
    """Serving: keeps a step's freed activations in the heap for the next step.

    With every block over 1 MiB mapped and unmapped on its own (or the heap's top trimmed
    after each step), each prefill step page-faulted its activations in afresh: a quarter of
    a 2048-token prefill went to the kernel zeroing pages. Blocks up to 32 MiB now stay in
    the heap and glibc never trims it by itself; the backend calls `trim_freed_memory`
    when prefilling gives way to decoding and when the worker goes idle.
    """
    if libc := _glibc():
        libc.mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD_MAX)
        libc.mallopt(M_TRIM_THRESHOLD, 1 << 30)


def trim_freed_memory() -> None:
    """Returns the heap's free pages to the OS (after loading, after prefill steps, when idle)."""
    if libc := _glibc():
        libc.malloc_trim(0)


def serving_collector() -> None:
    """The API process, once it serves: what start-up made (modules, the app, the tokenizer)
    lives as long as the process, out of the cyclic collector's sight, and the collector runs
    less often. Every streamed token allocates a few dozen objects, so with the default
    thresholds the collector ran every ~20 tokens; at 256 streams on a tiny model this took the
    API process's CPU per token from ~60 to ~53 us (medians of three alternating runs).
    Garbage with cycles waits a little longer to be freed: at most some megabytes."""
    gc.collect()
    gc.freeze()
    gc.set_threshold(*SERVING_GC_THRESHOLDS)
