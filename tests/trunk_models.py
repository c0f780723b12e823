"""The CPU trunks' test exports: one k3-mini checkpoint exported with --trunk dense, bf16 and int8 (ONNX).

The checkpoint's router bias picks the same top_k experts for every token: random weights are full of router
ties (two experts' scores a rounding apart) that any trunk's rounding flips, and a flipped expert changes the
logits by O(1); a trained router rarely sits on a tie. What the exports then differ by is the trunk alone.
"""

from __future__ import annotations

from pathlib import Path

import torch

TRUNKS = ("dense", "bf16", "int8")


def decisive_checkpoint(out: Path, dtype: torch.dtype = torch.float32) -> Path:
    """k3-mini (seed 0, MXFP4 experts) whose router bias fixes the routing (module docstring), saved to `out`."""
    from k3x.checkpoint.save import save_checkpoint
    from k3x.model import build_model, preset

    cfg = preset("k3-mini")
    model = build_model(cfg, seed=0)
    with torch.no_grad():
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.zero_()
                b[: cfg.moe.top_k] = 10.0
    model = model.to(dtype) if dtype != torch.float32 else model
    return save_checkpoint(model, out, expert_format="mxfp4")


def build_trunk_exports(root: Path) -> None:
    """root/ckpt and root/<trunk> for each of TRUNKS (ONNX, through the library as `k3x export` calls it)."""
    from k3x.exporter.options import ExportOptions, Target, Trunk
    from k3x.exporter.pipeline import export

    decisive_checkpoint(root / "ckpt")
    for trunk in TRUNKS:
        export(ExportOptions((Target.ONNX,), root / trunk, checkpoint=root / "ckpt", trunk=Trunk(trunk)))
