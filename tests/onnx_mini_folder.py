"""A k3-mini export folder (checkpoint, manifest, model.pt2, ONNX flavors), built once per test process.

Shared by the ONNX / runner / verify tests so the costly trace + export happens once; tests that change
files copy the folder first.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from pathlib import Path

import torch
from scratch_dirs import scratch_dir


@dataclass(frozen=True)
class MiniExport:
    folder: Path
    checkpoint: Path
    ep: torch.export.ExportedProgram


def export_folder(checkpoint: Path, out: Path, ep=None) -> tuple[Path, torch.export.ExportedProgram]:
    from k3x.checkpoint.files import load_checkpoint
    from k3x.checkpoint.reference import checkpoint_hash
    from k3x.exporter.onnx import onnx_stage
    from k3x.exporter.trace import op_counts, trace
    from k3x.folder.artifacts import init_manifest, write_artifact

    model = load_checkpoint(checkpoint, dtype=torch.float32)
    ep = ep or trace(model)
    init_manifest(out, model.cfg, dtype=torch.float32, weights=True, op_counts=op_counts(ep),
                  checkpoint=checkpoint, checkpoint_hash=checkpoint_hash(checkpoint))
    with write_artifact(out, "pt2") as tmp:
        torch.export.save(ep, tmp / "model.pt2")
    onnx_stage(out, ep, model.cfg)
    return out, ep


@functools.lru_cache(maxsize=1)
def mini_export() -> MiniExport:
    from k3x.checkpoint.save import save_checkpoint
    from k3x.model import build_model, preset

    root = scratch_dir("k3x-test-mini-")
    ckpt = root / "ckpt"
    save_checkpoint(build_model(preset("k3-mini"), seed=0), ckpt, expert_format="dense")
    folder, ep = export_folder(ckpt, root / "export")
    return MiniExport(folder, ckpt, ep)
