"""k3-mini end to end with kernels=triton vs kernels=reference: the kernels wired through torch.ops.k3.

Under the interpreter the tensors are CPU tensors, which the op's backend check refuses for 'triton'
(outside the interpreter Triton needs CUDA); the test lifts that check for itself only (conftest.py's
`allow_cpu_triton`).
"""

from __future__ import annotations

import torch

from k3x.model import build_model, empty_state, preset
from k3x.model.options import BuildOptions
from k3x.plan.kernels import Kernels
from tolerances import assert_close


def test_model_triton_matches_reference(allow_cpu_triton, device):
    cfg = preset("k3-mini")
    ref = build_model(cfg, device=device, seed=0)
    tri = build_model(cfg, BuildOptions(Kernels.TRITON), device=device, seed=0)
    ids = torch.randint(0, cfg.vocab_size, (1, 20), device=device)  # > 16 tokens: the chunked KDA kernels
    with torch.no_grad():
        s_ref, s_tri = empty_state(cfg, 1, device=device), empty_state(cfg, 1, device=device)
        for step in range(3):  # prefill, then decode steps carrying every state
            l_ref, s_ref = ref(ids, s_ref)
            l_tri, s_tri = tri(ids, s_tri)
            assert_close(l_tri, l_ref, torch.float32, f"logits step {step}")
            for i, (a, b) in enumerate(zip(s_tri, s_ref)):
                assert_close(a, b, torch.float32, f"state {i} step {step}")
            ids = l_ref[:, -1:].argmax(-1)
