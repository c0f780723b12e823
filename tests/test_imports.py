"""The reference path and `k3x --help` work where Triton and TensorRT cannot be imported (attention-gym's
`test_kda_imports`): kernels are imported lazily and only for kernels='triton'. A fresh process blocks them."""

from __future__ import annotations

import subprocess
import sys

SCRIPT = r'''
import sys

for name in ("triton", "tensorrt", "tensorrt_rtx", "tensorrt_bindings", "fla"):
    sys.modules[name] = None  # `import name` now raises ImportError, as if it were not installed
import torch
from typer.testing import CliRunner
from k3x.cli import app
from k3x.model import build_model, empty_state, preset
from k3x.exporter.trace import op_counts, trace

assert CliRunner().invoke(app, ["--help"]).exit_code == 0
cfg = preset("k3-mini")
model = build_model(cfg)
logits, state = model(torch.zeros(1, 5, dtype=torch.long), empty_state(cfg, 1))
assert logits.shape == (1, 5, cfg.vocab_size) and torch.isfinite(logits).all()
assert op_counts(trace(model)) == {"k3::attn_res": 12, "k3::kda": 3, "k3::moe": 5}
blocked = [m for m, mod in sys.modules.items() if mod is not None and m.split(".")[0] in ("triton", "tensorrt", "fla")]
assert not blocked, blocked
print("ok")
'''


def test_reference_path_needs_no_triton_or_tensorrt():
    r = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0 and r.stdout.strip().endswith("ok"), r.stdout + r.stderr
