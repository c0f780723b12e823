"""The CPU trunks: the dense projections with bf16 or 8-bit weights and fp32 activations (`BuildOptions.trunk`).

- "dense": `nn.Linear` in the model dtype (the default; every other path is this one).
- "bf16": `BF16Linear` holds nn.Linear's weight [N, K] in bf16 (a bf16 checkpoint's bytes unchanged) and
  computes through `k3::linear_bf16` (fp32 accumulation): half of fp32's bytes per decode step.
- "int8": `Q8Linear` holds 8-bit codes [N, ceil(K / 32), 32] and fp32 scales per block of 32 along K
  (symmetric absmax, custom_ops/linear_q8/reference.quantize) and computes through `k3::linear_q8` (ONNX
  Runtime's MatMulNBits): about 0.28 of fp32's bytes. Quantised at export, tensor by tensor.
Which projections: every `nn.Linear` the model calls as a module — KDA's and MLA's projections, the dense MLP,
the shared experts, the latent MoE's down / up projections and the lm_head. Not `kv_b_proj` (the absorbed
MLA reads its weight as two matrices, model/mla.py) nor the AttnRes d -> 1 projections (k3::attn_res reads
their weight): they stay in the model dtype, as do the embedding (one row gathered per token), norms, the
router and the routed experts (their own format, `expert_format`). The activations are fp32: a trunk export's
model dtype is fp32 (exporter/pipeline.py refuses another).
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from ..custom_ops.linear_bf16 import linear_bf16
from ..custom_ops.linear_q8 import linear_q8
from ..custom_ops.linear_q8.reference import BLOCK, quantize

TRUNKS = ("dense", "bf16", "int8")
KEPT = ("kv_b_proj", "_res_proj")  # module names whose weight an op or a matmul reads directly


class BF16Linear(nn.Module):
    """nn.Linear(bias=False) with its weight [N, K] in bf16; y = x @ weight^T in fp32."""

    def __init__(self, weight: Tensor) -> None:
        super().__init__()
        self.weight = nn.Parameter(weight.detach().to(torch.bfloat16), requires_grad=False)
        self.in_features, self.out_features = weight.shape[1], weight.shape[0]

    def forward(self, x: Tensor) -> Tensor:
        return linear_bf16(x, self.weight)


class Q8Linear(nn.Module):
    """nn.Linear(bias=False) with 8-bit block-quantised weights: `qweight` uint8 [N, KB, BLOCK], `scales` fp32
    [N, KB]; y = x @ dequantised^T in fp32. From a weight on the meta device: meta tensors of those shapes."""

    def __init__(self, weight: Tensor, block: int = BLOCK) -> None:
        super().__init__()
        n, k = weight.shape
        if weight.device.type == "meta":
            kb = -(-k // block)
            q, s = (torch.empty(n, kb, block, dtype=torch.uint8, device="meta"),
                    torch.empty(n, kb, dtype=torch.float32, device="meta"))
        else:
            q, s = quantize(weight.detach(), block)
        self.qweight = nn.Parameter(q, requires_grad=False)
        self.scales = nn.Parameter(s, requires_grad=False)
        self.in_features, self.out_features = k, n

    def forward(self, x: Tensor) -> Tensor:
        return linear_q8(x, self.qweight, self.scales)


def trunk_modules(model: nn.Module) -> list[str]:
    """The names of the modules a trunk converts, in module order."""
    return [name for name, m in model.named_modules()
            if type(m) is nn.Linear and m.bias is None and not name.endswith(KEPT)]


def convert_trunk(model: nn.Module, trunk: str) -> nn.Module:
    """Replace every trunk projection of `model` by its `trunk` form in place (its weight quantised or cast;
    meta weights give meta tensors); "dense" leaves the model as it is. Returns the model."""
    if trunk not in TRUNKS:
        raise ValueError(f"trunk={trunk!r}: expected one of {TRUNKS}")
    if trunk == "dense":
        return model
    make = BF16Linear if trunk == "bf16" else Q8Linear
    for name in trunk_modules(model):
        parent, _, leaf = name.rpartition(".")
        owner = model.get_submodule(parent) if parent else model
        setattr(owner, leaf, make(getattr(owner, leaf).weight))
    return model


def trunk_entries(name: str, weight: Tensor, trunk: str) -> list[tuple[str, Tensor]]:
    """A trunk projection's checkpoint entry `<module>.weight` [N, K] -> the state_dict entries of its `trunk`
    form: ("<module>.weight", bf16) or ("<module>.qweight", uint8), ("<module>.scales", fp32)."""
    module = name.removesuffix(".weight")
    if trunk == "bf16":
        return [(name, weight.to(torch.bfloat16))]
    q, s = quantize(weight)
    return [(f"{module}.qweight", q), (f"{module}.scales", s)]


def trunk_weight_names(model: nn.Module) -> set[str]:
    """The `<module>.weight` names of the trunk projections of a dense-trunk model (e.g. a checkpoint's)."""
    return {f"{m}.weight" for m in trunk_modules(model)}
