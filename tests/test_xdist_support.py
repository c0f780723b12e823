"""tests/xdist_support.py `share_cores`: on an xdist worker torch and the processes the worker starts run on
the worker's share of the cores, not on all of them (two workers each spreading OpenMP over every core
oversubscribed a 2-core machine: tests/model 47 s against 17-19 s)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch


def test_a_worker_and_its_children_use_its_share_of_the_cores(request):
    if not hasattr(request.config, "workerinput"):
        pytest.skip("runs on an xdist worker (the suite's default -n 2)")
    want = int(os.environ["OMP_NUM_THREADS"])  # share_cores set it (cores // workers), unless the caller had
    assert torch.get_num_threads() == want
    child = subprocess.run([sys.executable, "-c", "import torch; print(torch.get_num_threads())"],
                           capture_output=True, text=True, check=True)
    assert int(child.stdout) == want
