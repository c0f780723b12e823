"""runtime/host_memory.py: resident weights moved onto 2 MB pages, sparse memory left alone, the switch honoured."""

from __future__ import annotations

import ctypes
import mmap
import sys

import pytest

from k3x.runtime import host_memory



def thp_always() -> bool:
    try:
        with open("/sys/kernel/mm/transparent_hugepage/enabled") as f:
            return "[always]" in f.read()
    except OSError:
        return False


pytestmark = [pytest.mark.skipif(not sys.platform.startswith("linux"), reason="MADV_COLLAPSE is Linux's"),
              pytest.mark.skipif(thp_always(), reason="transparent huge pages `always`: every fault is huge already")]

SIZE = 16 << 20


def huge_kb(addr: int, size: int) -> int:
    """AnonHugePages (kB) of the mappings overlapping [addr, addr + size), from /proc/self/smaps."""
    total, inside = 0, False
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split()[0]
            if "-" in head and ":" not in head:
                lo, hi = (int(x, 16) for x in head.split("-"))
                inside = lo < addr + size and hi > addr
            elif inside and head == "AnonHugePages:":
                total += int(line.split()[1])
    return total


@pytest.fixture
def region():
    """An anonymous private mapping of SIZE bytes, its address."""
    buf = mmap.mmap(-1, SIZE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    addr = ctypes.addressof(ctypes.c_char.from_buffer(buf))
    yield buf, addr
    buf.close()


def supported(addr: int) -> bool:
    """Whether this kernel collapses at all (MADV_COLLAPSE arrived in Linux 6.1)."""
    libc = host_memory._libc()
    return libc.madvise((addr + host_memory.HUGE - 1) // host_memory.HUGE * host_memory.HUGE, host_memory.HUGE,
                        host_memory.MADV_COLLAPSE) == 0


def test_resident_memory_lands_on_huge_pages_with_its_contents(region):
    buf, addr = region
    buf.write(bytes(range(256)) * (SIZE // 256))  # every page resident, a pattern to check afterwards
    done = host_memory.collapse([(addr, addr + SIZE)])
    if done == 0 and not supported(addr):
        pytest.skip("this kernel has no MADV_COLLAPSE")
    assert done >= SIZE - host_memory.HUGE  # every aligned 2 MB chunk inside the span
    assert huge_kb(addr, SIZE) * 1024 >= done
    buf.seek(0)
    assert buf.read(SIZE) == bytes(range(256)) * (SIZE // 256)


def test_sparse_memory_is_left_alone(region):
    """A mapping with one page touched per 2 MB (a thread stack's shape) is not grown to huge pages."""
    buf, addr = region
    for off in range(0, SIZE, host_memory.HUGE):
        buf[off] = 1
    before = host_memory.resident_bytes()
    assert host_memory.collapse([(addr, addr + SIZE)]) == 0
    assert huge_kb(addr, SIZE) == 0
    assert host_memory.resident_bytes() - before < SIZE // 4


def test_small_loads_and_the_switch_skip_it(region, monkeypatch):
    buf, addr = region
    buf.write(b"\1" * SIZE)
    assert host_memory.weights_on_huge_pages(1 << 20) == 0  # under min_bytes: not worth a copy
    monkeypatch.setenv("K3X_HUGE_PAGES", "0")
    assert host_memory.weights_on_huge_pages(1 << 30) == 0
    assert huge_kb(addr, SIZE) == 0


def test_a_cpu_session_load_hands_its_growth_over(mini_cli_export, monkeypatch):
    """ort_session measures what the load added to the resident set and passes it on (the threshold decides)."""
    from k3x.runtime import ort_runner

    seen = []
    monkeypatch.setattr(ort_runner, "weights_on_huge_pages", lambda grown: seen.append(grown) or 0)
    ort_runner.OrtRunner(mini_cli_export.export / "model.onnx", provider="cpu")
    assert len(seen) == 1 and seen[0] > 0
