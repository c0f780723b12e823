"""Stage 1: `torch.export` of the K3 causal LM — one program serving prefill (empty past) and decode.

Dynamic dims are declared once here (`DYNAMIC_DIMS`) and reused by every later stage (ONNX dim_params,
TensorRT optimisation profiles). Inputs: `input_ids [batch, seq]` and the flat state of model/state.py
(`past_seq` on the MLA latent caches). Each custom op is one graph node (`op_counts`).
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

import torch
from torch.export import Dim, ExportedProgram

from ..model import K3Config, K3ForCausalLM
from ..model.state import state_specs


@dataclass(frozen=True)
class DimRange:
    name: str
    min: int
    opt: int
    max: int


# the one dynamic-dim table: (min, opt, max); opt is what optimisation profiles tune for
DYNAMIC_DIMS: dict[str, DimRange] = {
    "batch": DimRange("batch", 1, 1, 64),
    "seq": DimRange("seq", 1, 128, 4096),
    "past_seq": DimRange("past_seq", 0, 128, 8192),
}


def torch_dims() -> dict[str, Dim]:
    return {n: Dim(n, min=r.min, max=r.max) for n, r in DYNAMIC_DIMS.items()}


def dynamic_shapes(cfg: K3Config) -> dict:
    d = torch_dims()
    past = [{0: d["batch"], 1: d["past_seq"]} if s.kind == "latent" else {0: d["batch"]} for s in state_specs(cfg)]
    return {"input_ids": {0: d["batch"], 1: d["seq"]}, "past": past}


def example_inputs(cfg: K3Config, *, dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu",
                   batch: int = 2, seq: int = 3, past_seq: int = 2) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """Example inputs with every dynamic dim >= 2 (0/1 would specialise); values are irrelevant."""
    ids = torch.zeros(batch, seq, dtype=torch.long, device=device)
    past = [torch.zeros(s.shape(batch, past_seq), dtype=torch.float32 if s.fp32 else dtype, device=device)
            for s in state_specs(cfg)]
    return ids, past


def trace(model: K3ForCausalLM, *, dtype: torch.dtype | None = None) -> ExportedProgram:
    """Export `model` (real weights or the meta device) with the dynamic dims of DYNAMIC_DIMS."""
    p = next(model.parameters())
    dtype = dtype or p.dtype
    ids, past = example_inputs(model.cfg, dtype=dtype, device=p.device)
    with torch.no_grad():
        return torch.export.export(model, (ids, past), dynamic_shapes=dynamic_shapes(model.cfg))


def op_counts(ep: ExportedProgram) -> dict[str, int]:
    """Custom-op node counts, keyed like `k3::kda`."""
    c = Counter(n.target.name().split(".")[0] for n in ep.graph.nodes
                if n.op == "call_function" and hasattr(n.target, "name") and n.target.name().startswith("k3::"))
    return dict(sorted(c.items()))
