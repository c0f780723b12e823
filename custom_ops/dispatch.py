"""The process's kernel dispatcher (plan/dispatch.py) over the tables committed in custom_ops/tuned/.

`DISPATCH` picks, inside a family's CUDA implementation, among the candidates the family declares (its
`candidates.py`), from `custom_ops/tuned/<kind>.json` for the GPU this process runs on (kind from
`torch.cuda.get_device_name()`; 'cpu' without CUDA, as under the Triton interpreter, where no table exists and
the default order applies). `bench/gpu_check.py --only tune` measures the table on a device and writes it in
this form; the lead commits it here.
"""

from __future__ import annotations

from pathlib import Path

from ..plan.dispatch import Dispatcher, gpu_kind

TUNED = Path(__file__).resolve().parent / "tuned"


def device_kind() -> str:
    """The table name of CUDA device 0 ('cpu' without CUDA)."""
    import torch

    return gpu_kind(torch.cuda.get_device_name()) if torch.cuda.is_available() else "cpu"


DISPATCH = Dispatcher(TUNED, device_kind)
