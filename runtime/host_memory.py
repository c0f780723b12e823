"""The host memory a CPU session's weights live in: freed load memory handed back, weights moved onto huge pages.

Notable choices:
- `release_freed_heap`: what a session load freed (ONNX Runtime's constant folding copies weights) goes back to
  the OS (glibc `malloc_trim`): k3-bench RSS after load 1,508 -> 1,177 MB.
- `weights_on_huge_pages`: a decode step streams every weight once, and on 4 KB pages each 2 MB of weights costs
  512 TLB entries; on this kind of machine (2-core AMD EPYC Zen 4 VM) one core streamed 18-20 GB/s from 4 KB
  pages and ~32 GB/s from 2 MB pages. ONNX Runtime allocates its weights (and its prepacked copies) with plain
  malloc, which gets 4 KB pages unless transparent huge pages are `always`. After a load the process's private
  writable memory is collapsed onto 2 MB pages in place (`madvise(MADV_COLLAPSE)`, Linux 6.1+; independent of
  the THP `enabled` setting). k3-bench decode, MXFP4 experts, 2 threads: int8 trunk 10.5 -> 8.6 ms/token, bf16
  13.8 -> 12.7.
  - Only 2 MB chunks whose 512 pages are all resident (`mincore`) are collapsed, so a thread stack or a sparse
    mapping never grows (k3-bench int8 trunk: 359 MB collapsed, RSS 636 -> 636 MB). A chunk already on a huge
    page costs two syscalls, so calling it after every load is cheap (2.0 ms for that process's second pass).
  - Best effort: a kernel without MADV_COLLAPSE, a non-Linux host or a chunk the kernel refuses (EINVAL, EAGAIN,
    ENOMEM) is skipped; nothing depends on it but speed. `K3X_HUGE_PAGES=0` turns it off.
  - Collapsing copies: 0.7-1.3 s for k3-bench's 360-560 MB on first load, so it runs only where the load grew
    the resident set by at least `min_bytes`.
"""

from __future__ import annotations

import ctypes
import os
import sys

HUGE = 2 << 20  # x86-64 / arm64 (4 KB base pages) PMD size
MADV_COLLAPSE = 25


def release_freed_heap() -> None:
    """Hand memory the process freed back to the OS (glibc only; elsewhere nothing to do)."""
    if sys.platform.startswith("linux"):
        try:
            ctypes.CDLL("libc.so.6").malloc_trim(0)
        except (OSError, AttributeError):  # no glibc (no libc.so.6 or no malloc_trim): nothing to hand back
            pass


def _libc():
    libc = ctypes.CDLL("libc.so.6", use_errno=True)
    libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_char_p]
    return libc


def _private_writable() -> list[tuple[int, int]]:
    """[start, end) of the process's private writable anonymous mappings and its heap, from /proc/self/maps."""
    spans = []
    with open("/proc/self/maps") as f:
        for line in f:
            parts = line.split()
            named = parts[5] if len(parts) > 5 else ""
            if parts[1].startswith("rw") and parts[1].endswith("p") and named in ("", "[heap]"):
                lo, hi = (int(x, 16) for x in parts[0].split("-"))
                spans.append((lo, hi))
    return spans


def collapse(spans: list[tuple[int, int]]) -> int:
    """Collapse every fully resident, 2 MB-aligned chunk of `spans` onto a huge page; returns the bytes now on
    huge pages (0 where the kernel offers no MADV_COLLAPSE)."""
    libc = _libc()
    resident = ctypes.create_string_buffer(HUGE // 4096)
    done = 0
    for lo, hi in spans:
        for chunk in range((lo + HUGE - 1) // HUGE * HUGE, hi // HUGE * HUGE, HUGE):
            if libc.mincore(chunk, HUGE, resident) == 0 and 0 not in resident.raw \
                    and libc.madvise(chunk, HUGE, MADV_COLLAPSE) == 0:  # bit 0 of each byte: page resident
                done += HUGE
    return done


def resident_bytes() -> int:
    """The process's resident set (0 where /proc is missing)."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError):
        return 0


def weights_on_huge_pages(loaded_bytes: int, min_bytes: int = 64 << 20) -> int:
    """After a CPU session load that grew the resident set by `loaded_bytes`: the process's resident private
    memory onto 2 MB pages (module docstring); returns the bytes collapsed (0: skipped or unsupported)."""
    if loaded_bytes < min_bytes or os.environ.get("K3X_HUGE_PAGES", "1") == "0" \
            or not sys.platform.startswith("linux"):
        return 0
    try:
        return collapse(_private_writable())
    except (OSError, AttributeError):  # no glibc, no /proc: the weights stay where they are
        return 0
