"""`k3::MoE` plugin: the routed (latent) MoE over `custom_ops/moe/triton.py`.

    MoE(x [N, d], z [N, L] (one dtype, fp32|fp16|bf16), gate_weight [E, d] (fp32|fp16|bf16), gate_bias [E] fp32,
        w1, w3 [E, I, L], w2 [E, L, I] (one dtype, fp32|fp16|bf16); top_k, routed_scaling_factor, renormalize,
        activation, situ_beta, situ_linear_beta, num_experts, hidden_size, expert_dim, intermediate_size)
        -> u [N, L] (z's dtype).  LINEAR only; N dynamic, d/L/E/I static (weights).  Output shape:
    `moe_output_shape` (custom_ops/moe/op.py) — static (= z's shape) although the work inside is data-dependent.

Kernels, as the torch op runs them (`triton.moe`), eight launches in one variant: router -> top-k ->
align count / scan / scatter -> grouped GEMM1 (gate+up, GLU epilogue) -> GEMM2 (× routing weight, rows
un-permuted) -> per-token sum over the k slots in slot order (deterministic: no atomics). Intermediates live
in the TensorRT workspace: scores s [N, E] fp32, ids [N·k] int64, wts [N·k] fp32, counts and offsets [NB, E] int32,
sorted_pair [P] int32, block_expert [P/BM] int32, h [P, I] (z's dtype), y [N·k, L] fp32, with
P = `padded_rows(N·k, E, BM)` the worst case, so grids and workspace depend on N alone;
`get_workspace_size` evaluates them at the profile's max N. Block sizes (BM included) are chosen at the opt
shape (`moe_launch_config`); grids and int32 sizes follow the runtime N. top_k, the routing factor, the
renormalisation, the activation and its betas are specialised into the code. d, L, E, I and P are passed as
16-divisible int32s where they are (the JIT's specialisation), and the runtime shapes are checked against them.
Paths: IPluginV3 "aot" (cubins in the engine, launched through the CUDA driver); "jit" calls `triton.moe`
(debugging). QDP (TensorRT 11): `impl` only — `aot_impl` carries a single kernel.
"""

from __future__ import annotations

from ..custom_ops.moe import moe_output_shape
from ..custom_ops.moe import triton as kt
from .core import FLOAT, ITEMSIZE, Buffer, Launch, Plan, PluginError, PluginSpec, Port, Variant, cdiv, schema_fields

def dims(shapes) -> dict:
    (N, d), (_, L), (E, I, _) = shapes[0], shapes[1], shapes[4]
    return {"N": N, "d": d, "L": L, "E": E, "I": I}


def _eq(a, b) -> bool:
    return a is None or b is None or a == b


def check(shapes, attrs: dict) -> str | None:
    x, z, gw, gb, w1, w3, w2 = (list(s) for s in shapes)
    if [len(s) for s in (x, z, gw, gb, w1, w3, w2)] != [2, 2, 2, 1, 3, 3, 3]:
        return f"ranks {[len(s) for s in (x, z, gw, gb, w1, w3, w2)]}, expected [2, 2, 2, 1, 3, 3, 3]"
    (N, d), L, (E, I, _) = x, z[1], w1
    want = {"z": ([N, L], z), "gate_weight": ([E, d], gw), "gate_bias": ([E], gb), "w1": ([E, I, L], w1),
            "w3": ([E, I, L], w3), "w2": ([E, L, I], w2)}
    for name, (w, got) in want.items():
        if not all(_eq(a, b) for a, b in zip(got, w)):
            return f"{name} has shape {got}, expected {w} (x {x}, w1 {w1})"
    for f, v in (("num_experts", E), ("hidden_size", d), ("expert_dim", L), ("intermediate_size", I)):
        if not _eq(attrs.get(f), v):
            return f"field {f}={attrs.get(f)} does not match the tensors' {v}"
    if attrs.get("activation") not in (None, "situ", "silu"):
        return f"field activation={attrs.get('activation')!r}: expected 'situ' or 'silu'"
    if E is not None and "top_k" in attrs and not 1 <= attrs["top_k"] <= E:
        return f"field top_k={attrs['top_k']} outside [1, {E}]"
    return None


def _ieee(*dtypes: str) -> bool:
    """As `triton._ieee`: fp32 IEEE dots unless every operand has the same 16-bit dtype (then tensor cores)."""
    return not (len(set(dtypes)) == 1 and dtypes[0] in ("fp16", "bf16"))


def plan(d: dict, dtypes: list[str], attrs: dict) -> Plan:
    """The eight launches of `triton.moe`, configured at the opt dims `d` (BM and tiles fixed there)."""
    E, I, L, D, k = d["E"], d["I"], d["L"], d["d"], int(attrs["top_k"])
    c = kt.moe_launch_config(max(int(d["N"]), 1), k, E, L, I, ITEMSIZE[dtypes[1]])
    BM, r, t, a, g1, g2, su = c["BM"], c["router"], c["topk"], c["align"], c["gemm1"], c["gemm2"], c["sum"]
    static = {"d": D, "L": L, "E": E, "I": I}

    def sizes(x: dict) -> dict:
        """Every int32 argument at runtime dims `x` (N dynamic; the weight dims must be the planned ones)."""
        for name, v in static.items():
            if x[name] != v:
                raise PluginError(f"k3::MoE: runtime {name}={x[name]} differs from the planned {v} (static dim)")
        NK = x["N"] * k
        P = kt.padded_rows(NK, E, BM)
        return {"N": x["N"], "NK": NK, "NB": cdiv(NK, kt.ALIGN_BLOCK), "P": P, "num_m": P // BM} | static

    div16 = {n for n, v in static.items() if v % 16 == 0} | {"P"}  # P is a multiple of BM >= 16

    def launch(kernel, args, constexprs, grid, cfg):
        return Launch(kernel, args, constexprs, grid=grid, scalars=sizes, num_warps=cfg["num_warps"],
                      num_stages=cfg["num_stages"], divisible=tuple(n for n in args if n in div16))

    num_m = lambda x: sizes(x)["num_m"]  # noqa: E731
    nb = lambda x: sizes(x)["NB"]  # noqa: E731
    x_t, z_t, gw_t, w_t = dtypes[0], dtypes[1], dtypes[2], dtypes[4]
    launches = (
        launch(kt._router_kernel, ("x", "gate_weight", "s", "N", "E", "d"),
               {"BM": r["BM"], "BN": r["BN"], "BK": r["BK"], "IEEE": _ieee(x_t, gw_t)},
               lambda x: (cdiv(x["N"], r["BM"]), cdiv(E, r["BN"]), 1), r),
        launch(kt._topk_kernel, ("s", "gate_bias", "ids", "wts", "E"),
               {"factor": float(attrs["routed_scaling_factor"]), "TOPK": k, "KP": t["KP"], "EP": t["EP"],
                "RENORM": bool(attrs["renormalize"])}, lambda x: (x["N"], 1, 1), t),
        launch(kt._moe_align_count_kernel, ("ids", "counts", "NK", "E"), {"BLOCK": a["BLOCK"], "BE": a["BE"]},
               lambda x: (nb(x), 1, 1), a),
        launch(kt._moe_align_scan_kernel, ("counts", "offsets", "sorted_pair", "block_expert", "NK", "E", "NB", "P"),
               {"BM": BM, "EP": a["EP"], "BB": a["BB"], "BP": a["BP"]}, lambda x: (1, 1, 1), a),
        launch(kt._moe_align_scatter_kernel, ("ids", "offsets", "sorted_pair", "NK", "E"),
               {"BLOCK": a["BLOCK"], "BJ": a["BJ"]}, lambda x: (nb(x), 1, 1), a),
        launch(kt._moe_gemm1_kernel, ("z", "w1", "w3", "sorted_pair", "block_expert", "h", "NK", "I", "L", "num_m"),
               {"beta1": float(attrs["situ_beta"]), "beta2": float(attrs["situ_linear_beta"]), "TOPK": k, "BM": BM,
                "BN": g1["BN"], "BK": g1["BK"], "GROUP_M": g1["GROUP_M"], "ACT": kt.ACTIVATIONS[attrs["activation"]],
                "IEEE": _ieee(z_t, w_t)}, lambda x: (num_m(x) * cdiv(I, g1["BN"]), 1, 1), g1),
        launch(kt._moe_gemm2_kernel, ("h", "w2", "sorted_pair", "block_expert", "wts", "y", "NK", "I", "L", "num_m"),
               {"BM": BM, "BN": g2["BN"], "BK": g2["BK"], "GROUP_M": g2["GROUP_M"], "IEEE": _ieee(z_t, w_t)},
               lambda x: (num_m(x) * cdiv(L, g2["BN"]), 1, 1), g2),
        launch(kt._moe_sum_kernel, ("y", "u", "L"), {"TOPK": k, "BL": su["BL"]},
               lambda x: (x["N"], cdiv(L, su["BL"]), 1), su),
    )
    ws = (Buffer("s", "fp32", lambda x: x["N"] * E), Buffer("ids", "int64", lambda x: x["N"] * k),
          Buffer("wts", "fp32", lambda x: x["N"] * k), Buffer("counts", "int32", lambda x: nb(x) * E),
          Buffer("offsets", "int32", lambda x: nb(x) * E),
          Buffer("sorted_pair", "int32", lambda x: sizes(x)["P"]), Buffer("block_expert", "int32", num_m),
          Buffer("h", z_t, lambda x: sizes(x)["P"] * I), Buffer("y", "fp32", lambda x: x["N"] * k * L))
    return Plan((Variant("experts", launches),), workspace=ws)


def jit(inputs, outputs, attrs: dict) -> None:
    from ..custom_ops.moe import triton as kt

    outputs[0].copy_(kt.moe(*inputs, attrs["top_k"], attrs["routed_scaling_factor"], bool(attrs["renormalize"]),
                            attrs["activation"], attrs["situ_beta"], attrs["situ_linear_beta"]))


SPEC = PluginSpec(
    name="MoE",
    inputs=(Port("x", FLOAT), Port("z", FLOAT, "x"), Port("gate_weight", FLOAT), Port("gate_bias", ("fp32",)),
            Port("w1", FLOAT), Port("w3", FLOAT, "w1"), Port("w2", FLOAT, "w1")),
    outputs=(Port("u", FLOAT, "z"),),
    fields=schema_fields("MoE"),
    output_shapes=lambda s: [moe_output_shape(s[1])],
    output_dtypes=lambda t: [t[1]],
    dims=dims, check=check, plan=plan, jit=jit,
    notes="IPluginV3 aot: 8 cubins (router, top-k, align count/scan/scatter, GEMM1, GEMM2, sum); QDP: impl only",
)


def register_qdp(trtp, *, sm: int, opt_dims: dict) -> None:
    """TensorRT 11 QDP registration of `k3::MoE` (JIT `impl` only: `aot_impl` carries one kernel, MoE needs
    eight; needs `tensorrt.plugin`)."""
    from . import qdp

    @trtp.register("k3::MoE")
    def _desc(x: trtp.TensorDesc, z: trtp.TensorDesc, gate_weight: trtp.TensorDesc, gate_bias: trtp.TensorDesc,
              w1: trtp.TensorDesc, w3: trtp.TensorDesc, w2: trtp.TensorDesc, top_k: int, routed_scaling_factor: float,
              renormalize: int, activation: str, situ_beta: float, situ_linear_beta: float, num_experts: int,
              hidden_size: int, expert_dim: int, intermediate_size: int) -> trtp.TensorDesc:
        return qdp.output_descs(trtp, SPEC, [x, z, gate_weight, gate_bias, w1, w3, w2], {})

    @trtp.autotune("k3::MoE")
    def _tune(x, z, gate_weight, gate_bias, w1, w3, w2, outputs):
        return qdp.autotune(trtp, SPEC)

    @trtp.impl("k3::MoE")
    def _impl(x, z, gate_weight, gate_bias, w1, w3, w2, top_k: int, routed_scaling_factor: float, renormalize: int,
              activation: str, situ_beta: float, situ_linear_beta: float, num_experts: int, hidden_size: int,
              expert_dim: int, intermediate_size: int, outputs, stream: int) -> None:
        attrs = {"top_k": top_k, "routed_scaling_factor": routed_scaling_factor, "renormalize": renormalize,
                 "activation": activation, "situ_beta": situ_beta, "situ_linear_beta": situ_linear_beta}
        qdp.jit(SPEC, [x, z, gate_weight, gate_bias, w1, w3, w2], list(outputs), attrs, stream)
