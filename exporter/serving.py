"""The serving-step interface of an export (`k3x export --serving`): trace, dims, manifest entry, ONNX names.

The step (model/serving.py K3ServingStep) takes packed tokens of B sequences and the state pools; every size
a deployment picks at run time is dynamic: N tokens, B sequences, MB blocks of the step's longest sequence,
M logits rows, S slots, NB latent blocks. The block size BS is fixed here and recorded in the manifest
(`serving: {block_size, inputs, outputs, dims}`) so runners know the interface without reading a graph.
"""

from __future__ import annotations

import re
from typing import TYPE_CHECKING

import torch
from torch.export import Dim, ExportedProgram

from ..model.serving import STEP_INPUTS, K3ServingStep, pool_names
from ..model.state import pool_dims

if TYPE_CHECKING:
    import onnx_ir as ir

    from ..model import K3Config, K3ForCausalLM

# (min, opt, max) of each dynamic dim; opt is what an engine's optimisation profile tunes for: a step of the
# runtime's defaults (ServeOptions: 8 sequences, a 512-token budget; 1,024 positions each at block size 16).
# Examples are distinct and >= 2 so that none specialises or unifies
SERVING_DIMS: dict[str, tuple[int, int, int]] = {
    "tokens": (1, 512, 65536), "seqs": (1, 8, 1024), "table_blocks": (1, 64, 65536), "logits_rows": (1, 8, 65536),
    "slots": (1, 8, 4096), "blocks": (1, 512, 1 << 22)}
# K3ServingStep holds the whole model as its `lm` child: a checkpoint's tensor names gain this prefix in the step
WEIGHT_PREFIX = "lm."
_EXAMPLE = {"tokens": 11, "seqs": 3, "table_blocks": 5, "logits_rows": 2, "slots": 4, "blocks": 7}


def serving_manifest(cfg: K3Config, block_size: int) -> dict:
    names = pool_names(cfg)
    return {"block_size": block_size, "inputs": [*STEP_INPUTS, *(p for p, _ in names)],
            "outputs": ["logits", *(n for _, n in names)], "pools": pool_dims(cfg, block_size),
            "dims": {n: {"min": lo, "opt": opt, "max": hi} for n, (lo, opt, hi) in SERVING_DIMS.items()}}


def _dynamic_shapes(cfg: K3Config) -> dict:
    d = {n: Dim(n, min=lo, max=hi) for n, (lo, _, hi) in SERVING_DIMS.items()}
    pools = [{0: d[dims[0]]} for dims in pool_dims(cfg, 1).values()]  # slots / blocks
    return {"input_ids": {0: d["tokens"]}, "cu_seqlens": {0: d["seqs"] + 1}, "past_lens": {0: d["seqs"]},
            "slots": {0: d["seqs"]}, "block_table": {0: d["seqs"], 1: d["table_blocks"]},
            "logits_index": {0: d["logits_rows"]}, "pools": pools}


def example_inputs(cfg: K3Config, block_size: int, *, dtype: torch.dtype, device) -> tuple:
    """A valid step at the example sizes: 3 sequences of 4 + 4 + 3 tokens, pasts 2, 0, 9."""
    e, i32 = _EXAMPLE, torch.int32
    ids = torch.zeros(e["tokens"], dtype=torch.long, device=device)
    cu = torch.tensor([0, 4, 8, 11], dtype=i32, device=device)
    past = torch.tensor([2, 0, min(9, e["table_blocks"] * block_size - 3)], dtype=i32, device=device)
    slots = torch.tensor([3, 0, 1], dtype=i32, device=device)
    table = torch.arange(e["seqs"] * e["table_blocks"], dtype=i32, device=device).view(e["seqs"], -1) % e["blocks"]
    rows = torch.tensor([3, 10], dtype=torch.long, device=device)
    pools = [torch.zeros([e.get(d, d) for d in dims], dtype=dtype if name.endswith(".latent") else torch.float32,
                         device=device) for name, dims in pool_dims(cfg, block_size).items()]
    return ids, cu, past, slots, table, rows, pools


def trace_serving(model: K3ForCausalLM, *, block_size: int, kernels: str) -> ExportedProgram:
    """torch.export of the serving step over `model`'s own modules (real weights or meta)."""
    p = next(model.parameters())
    step = K3ServingStep(model, kernels=kernels)
    args = example_inputs(model.cfg, block_size, dtype=p.dtype, device=p.device)
    with torch.no_grad(), torch._dynamo.config.patch(fake_tensor_cache_enabled=False):
        return torch.export.export(step, args, dynamic_shapes=_dynamic_shapes(model.cfg))


def rename_serving_io(model: ir.Model, serving: dict) -> None:
    """Name the ONNX graph's inputs / outputs as the manifest's `serving` entry (and its dims by name)."""
    import onnx_ir as ir

    g = model.graph
    inputs, outputs = list(g.inputs)[: len(serving["inputs"])], list(g.outputs)
    if len(inputs) != len(serving["inputs"]) or len(outputs) != len(serving["outputs"]):
        raise ValueError(f"serving graph has {len(g.inputs)} inputs / {len(outputs)} outputs; expected "
                         f"{len(serving['inputs'])} / {len(serving['outputs'])}")
    sym = {}
    for v, axes in ((inputs[0], ["tokens"]), (inputs[2], ["seqs"]), (inputs[4], ["seqs", "table_blocks"]),
                    (inputs[5], ["logits_rows"])):
        sym.update({str(v.shape[k]): n for k, n in enumerate(axes)})
    for name, v in zip(serving["inputs"][len(STEP_INPUTS):], inputs[len(STEP_INPUTS):]):
        sym[str(v.shape[0])] = "blocks" if name.endswith(".latent") else "slots"
    pattern = re.compile(r"\b(" + "|".join(re.escape(k) for k in sorted(sym, key=len, reverse=True)) + r")\b")
    for v in [*inputs, *outputs]:
        if v.shape is not None:
            v.shape = ir.Shape([ir.SymbolicDim(pattern.sub(lambda m: sym[m.group(1)], d.value))
                                if isinstance(d, ir.SymbolicDim) and d.value else d for d in v.shape])
    for v, name in zip([*inputs, *outputs], [*serving["inputs"], *serving["outputs"]]):
        v.name = name
