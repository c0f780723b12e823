"""Random initialisation for test checkpoints (`k3x init-checkpoint`): O(1) activations and logits.

Linear/conv weights ~ N(0, 1/fan_in); norms 1; AttnRes pseudo-queries and the router bias small random
(so every branch is exercised); A_log and dt_bias as fla initialises them for the gate in use.
"""

from __future__ import annotations

import math

import torch

from . import mxfp4
from .config import ConfigError
from .model import K3ForCausalLM
from .options import BuildOptions
from .trunk import convert_trunk


@torch.no_grad()
def init_weights(model: K3ForCausalLM, seed: int = 0) -> K3ForCausalLM:
    gen = torch.Generator().manual_seed(seed)
    cfg = model.cfg

    def normal_(t: torch.Tensor, std: float) -> None:
        t.copy_(torch.randn(t.shape, generator=gen, dtype=torch.float32) * std)

    params = dict(model.named_parameters())
    for name, p in params.items():
        leaf = name.rsplit(".", 1)[-1]
        if p.dtype == torch.uint8:  # MXFP4-packed experts: N(0, 1/in) weights, quantised (scales with them)
            if not leaf.endswith("_scale"):
                E, out, half = p.shape
                w = torch.randn(E * out, 2 * half, generator=gen) / math.sqrt(2 * half)
                packed, scale = mxfp4.quantize(w)
                p.copy_(packed.view(p.shape))
                params[f"{name}_scale"].copy_(scale.view(params[f"{name}_scale"].shape))
        elif name.endswith(("norm.weight", "layernorm.weight")):
            p.fill_(1.0)
        elif name.endswith("_res_proj.weight"):
            normal_(p, 0.5 / math.sqrt(p.shape[-1]))
        elif leaf == "A_log":
            p.copy_(torch.zeros(p.shape) if cfg.kda.gate_lower_bound is not None
                    else torch.empty(p.shape).uniform_(1, 16, generator=gen).log())
        elif leaf == "dt_bias":
            dt = torch.exp(torch.empty(p.shape).uniform_(math.log(1e-3), math.log(0.1), generator=gen)).clamp(min=1e-4)
            p.copy_(dt + torch.log(-torch.expm1(-dt)))
        elif "embed_tokens" in name:
            normal_(p, 1.0)
        elif p.dim() >= 2:
            normal_(p, 1.0 / math.sqrt(p.shape[-1] if p.dim() == 2 or "experts" in name else p[0].numel()))
        else:
            normal_(p, 0.02)
    for name, b in model.named_buffers():
        if name.endswith("e_score_correction_bias"):
            normal_(b, 0.02)
    return model


def build_model(cfg, build: BuildOptions | None = None, *, device: str | torch.device = "cpu",
                dtype: torch.dtype = torch.float32, seed: int | None = 0) -> K3ForCausalLM:
    """A model of architecture `cfg` built as `build` says (kernels, expert format, trunk; default reference,
    dense, dense) on `device`; `seed=None` leaves parameters uninitialised (weights come from a checkpoint). A
    bf16 / int8 trunk is made from the dense weights once they are initialised (model/trunk.py)."""
    build = build or BuildOptions()
    if build.trunk != "dense" and dtype != torch.float32:
        raise ConfigError(f"trunk={build.trunk!r}: the activations of a {build.trunk} trunk are fp32 (the "
                          f"projections' weights are {build.trunk}); build it with dtype float32, not {dtype}")
    with torch.device(device):
        model = K3ForCausalLM(cfg, build)
    if seed is not None and torch.device(device).type != "meta":
        init_weights(model, seed)
    fp32_names = ("A_log", "dt_bias", "e_score_correction_bias", "norm.weight")  # gates, router bias, norms
    for name, t in list(model.named_parameters()) + list(model.named_buffers()):
        if not name.endswith(fp32_names) and t.dtype.is_floating_point:  # packed MXFP4 experts stay uint8
            t.data = t.data.to(dtype)
    return convert_trunk(model, build.trunk).eval()
