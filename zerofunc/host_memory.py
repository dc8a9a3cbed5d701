"""A rank's heap keeps the memory a step frees, for the next step, instead of giving it back to the kernel.

A step frees and allocates the same buffers every time: the gradients backward makes, the activations,
the reductions' buffers. glibc's malloc gives the top of its heap back to the kernel once more of it is
free than its trim threshold, and serves a chunk above its mmap threshold by a mapping of its own, unmapped
when freed (both thresholds grow with what is freed, to 32 MiB and 64 MiB). Memory given back is faulted in
again, a zeroed 4 KiB page at a time, where the next step first writes it. Measured on this project's CPU
(2 cores, torch 2.13, one thread): six 20 MB tensors allocated and filled, 59 ms a time with their 19,500
faults, 22 ms with none; the 30m model's step at stage 0, 2 gloo ranks (benchmarks/step_phases.py
--faults): 5,600-23,000 faults a step eager and 23,000-29,000 compiled whole, none with the settings here.
PyTorch's CPU performance guide gives the same reason for jemalloc or tcmalloc, which keep freed memory;
glibc keeps it with two settings, made here in each rank (zerofunc/launch.py).

What it costs: a rank's resident memory stays at its high-water mark of chunks up to 32 MiB (glibc's
largest mmap threshold); larger ones are still mapped and unmapped. The peak is unchanged."""
from __future__ import annotations

import ctypes

# glibc's malloc.h
M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3
MMAP_THRESHOLD_MAX = 32 * 2**20  # glibc's largest on 64-bit (DEFAULT_MMAP_THRESHOLD_MAX); a larger one is refused
TRIM_THRESHOLD = 2**31 - 1  # mallopt takes an int: never trim, short of 2 GiB free at the heap's top


def keep_freed_memory() -> bool:
    """Tell the C library's malloc to keep freed memory in this process (glibc's `mallopt`); False where
    the C library has no such setting (not glibc), and nothing changes."""
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    # both set: setting either stops glibc moving the thresholds itself
    return mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD_MAX) == 1 and mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD) == 1
