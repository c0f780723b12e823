"""k3::kda_decode, Triton: the whole KDA decode step of one layer in one kernel, its launch plan and the torch
launcher. Never imports `reference.py`.

`_kda_decode_kernel`, grid cdiv(B·H, TILES): program p runs the (sequence, head) tiles p, p + grid, ... (TILES of
them, strided so every program gets a similar share). Per tile (b, h), pool row slot = slots[b]:
  1. short conv: the head's q, k, v channels' window = conv_pool[slot, ch, :] | qkv[b, ch]; y = Σ window·w,
     SiLU; the window shifted by one is the new conv row (written to new_conv[b], or to conv_pool[slot] in
     place). Heads own disjoint channels, so the conv rows are read and written once.
  2. q, k L2-normalised (eps 1e-6), q scaled; decay gate from f, A_log[h], dt_bias (K3's lb·σ(e^A (f + dt))
     when GATE_LB != 0, Kimi Linear's −e^A·softplus(f + dt) otherwise); β = σ(b).
  3. the [K, V] fp32 state read once from state_pool[slot, h], decayed, delta-corrected, read out (after the
     write), written once (new_state[b], or state_pool[slot, h] in place).
  4. o = RMSNorm_V(Sᵀq)·norm_weight·σ(gate), stored in qkv's dtype.
The full [K, V] state of a head stays in one program (the output norm needs the whole V row): 128×128 fp32
over 4 warps. TILES is chosen from the plan's B so the grid is one wave on sm_90 (`decode_launch_config`);
the grid follows the runtime B, so a plugin compiled at one B runs any (more tiles per program past it).
In place, every program reads the rows it writes before writing them and no two programs share a row
(distinct slots, disjoint channels), so aliasing is safe.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from ...plan.launch import SM90_SMS, Launch, Plan, Variant, cdiv, ctas_per_sm, run
from ..kda.op import KERNEL_HEAD_DIM


@triton.jit
def _conv_silu(x_row, pool_row, new_row, w, ch, m, live, W: tl.constexpr, BW: tl.constexpr):
    """SiLU(causal conv) of channels `ch` [BC] for one token; writes their shifted window to new_row."""
    j = tl.arange(0, BW)
    m2 = m[:, None] & live
    x = tl.load(x_row + ch, mask=m & live, other=0.0).to(tl.float32)  # [BC] this step's input
    p = pool_row + ch[:, None] * (W - 1) + j[None, :]
    past = tl.load(p, mask=m2 & (j[None, :] < W - 1), other=0.0)  # [BC, BW] the last W-1 inputs
    nxt = tl.load(p + 1, mask=m2 & (j[None, :] < W - 2), other=0.0)  # the same, shifted by one
    win = tl.where(j[None, :] == W - 1, x[:, None], past)
    wt = tl.load(w + ch[:, None] * W + j[None, :], mask=m[:, None] & (j[None, :] < W), other=0.0).to(tl.float32)
    y = tl.sum(win * wt, 1)
    nxt = tl.where(j[None, :] == W - 2, x[:, None], nxt)
    tl.store(new_row + ch[:, None] * (W - 1) + j[None, :], nxt, mask=m2 & (j[None, :] < W - 1))
    return y * tl.sigmoid(y)


@triton.jit
def _kda_decode_kernel(  # arguments in TensorRT QDP order: inputs, int32 scalars, outputs
    qkv, f, b, gate, conv_w, A_log, dt_bias, norm_w, conv_pool, state_pool, slots,
    B,
    o, new_conv, new_state,
    scale: tl.constexpr, eps: tl.constexpr, GATE_LB: tl.constexpr,
    H: tl.constexpr, K: tl.constexpr, V: tl.constexpr, W: tl.constexpr,
    BK: tl.constexpr, BV: tl.constexpr, BW: tl.constexpr, TILES: tl.constexpr, IN_PLACE: tl.constexpr,
):
    pid, nprog = tl.program_id(0), tl.num_programs(0)
    C: tl.constexpr = 2 * H * K + H * V
    o_k, o_v = tl.arange(0, BK), tl.arange(0, BV)
    m_k, m_v = o_k < K, o_v < V
    m_s = m_k[:, None] & m_v[None, :]
    nw = tl.load(norm_w + o_v, mask=m_v, other=0.0).to(tl.float32)
    for i in range(TILES):
        tile = pid + i * nprog  # (sequence, head) tiles strided over the programs
        live = tile < B * H
        tile = tl.where(live, tile, 0).to(tl.int64)
        i_b, i_h = tile // H, tile % H
        a = tl.exp(tl.load(A_log + i_h).to(tl.float32))
        dtb = tl.load(dt_bias + i_h * K + o_k, mask=m_k, other=0.0).to(tl.float32)
        slot = tl.load(slots + i_b).to(tl.int64)
        row = i_b  # where the new rows go: this step's row b, or the slot's row in place
        if IN_PLACE:
            row = slot
        x_row = qkv + i_b * C
        pool_row = conv_pool + slot * (C * (W - 1))
        new_row = new_conv + row * (C * (W - 1))
        q = _conv_silu(x_row, pool_row, new_row, conv_w, i_h * K + o_k, m_k, live, W, BW)
        k = _conv_silu(x_row, pool_row, new_row, conv_w, H * K + i_h * K + o_k, m_k, live, W, BW)
        v = _conv_silu(x_row, pool_row, new_row, conv_w, 2 * H * K + i_h * V + o_v, m_v, live, W, BW)
        q = q * tl.rsqrt(tl.sum(q * q, 0) + 1e-6) * scale
        k = k * tl.rsqrt(tl.sum(k * k, 0) + 1e-6)
        hb = tile  # = i_b * H + i_h
        fx = tl.load(f + hb * K + o_k, mask=m_k, other=0.0).to(tl.float32) + dtb
        if GATE_LB != 0.0:
            g = GATE_LB * tl.sigmoid(a * fx)
        else:
            g = -a * tl.where(fx > 20.0, fx, tl.log(1.0 + tl.exp(tl.minimum(fx, 20.0))))
        beta = tl.sigmoid(tl.load(b + hb).to(tl.float32))
        p_s = o_k[:, None] * V + o_v[None, :]
        S = tl.load(state_pool + (slot * H + i_h) * (K * V) + p_s, mask=m_s & live, other=0.0)
        S = S * tl.exp(g)[:, None]  # decay rows
        err = v - tl.sum(k[:, None] * S, 0)  # [BV]
        S = S + k[:, None] * (beta * err)[None, :]  # delta write
        out = tl.sum(q[:, None] * S, 0)  # read after the write
        tl.store(new_state + (row * H + i_h) * (K * V) + p_s, S, mask=m_s & live)
        rms = tl.rsqrt(tl.sum(out * out, 0) / V + eps)
        gt = tl.load(gate + hb * V + o_v, mask=m_v & live, other=0.0).to(tl.float32)
        y = out * rms * nw * tl.sigmoid(gt)
        tl.store(o + hb * V + o_v, y.to(o.dtype.element_ty), mask=m_v & live)


# Compiled resources on sm_90a (triton 3.8, K = V = 128, W = 4, bf16; `python -m k3x.bench.kernel_resources
# --family kda_decode` and tests/bench/test_kernel_resources.py recompile them):
# (num_warps, looped: TILES > 1) -> (registers per thread, dynamic shared memory bytes, spills?).
# Measured: 8 warps 125 / 198 registers (2 / 1 CTAs per SM), 16 warps 106 / 128 (1 CTA): 4 warps keep two
# CTAs per SM whether the program loops or not, without spills.
DECODE_RESOURCES_SM90 = {(4, False): (236, 2048, False), (4, True): (227, 2048, False)}  # looped: at B = 64
DECODE_WARPS = 4


def _np2(x: int) -> int:
    return triton.next_power_of_2(x)


def decode_launch_config(B: int, H: int, K: int, V: int) -> dict:
    """Block sizes and warps: the whole [K, V] state of a head per tile; TILES (sequence, head) tiles per program,
    the fewest that keep the grid cdiv(B·H, TILES) within one wave of sm_90 CTAs (DECODE_RESOURCES_SM90:
    a program that loops holds more registers than one that does not)."""
    def wave(looped: bool) -> int:
        regs, shared, _ = DECODE_RESOURCES_SM90[(DECODE_WARPS, looped)]
        return SM90_SMS * ctas_per_sm(regs, shared, DECODE_WARPS)
    tiles = 1 if B * H <= wave(False) else cdiv(B * H, wave(True))
    return {"BK": _np2(K), "BV": _np2(V), "TILES": tiles, "num_warps": DECODE_WARPS}


def dims(shapes) -> dict:
    """Named dims from the input shapes (qkv, f, b, gate, conv_weight, A_log, dt_bias, norm_weight, conv_pool,
    state_pool, slots)."""
    (B, H, K), V, W = shapes[1], shapes[3][2], shapes[4][1]
    return {"B": B, "H": H, "K": K, "V": V, "W": W}


def plan(d: dict, dtypes: list[str], attrs: dict) -> Plan:
    """The one launch of k3::kda_decode at dims `d` (B, H, K, V, W). Ports: qkv, f, b, gate, conv_weight,
    A_log, dt_bias, norm_weight, conv_pool, state_pool, slots -> o, new_conv, new_state. `attrs["in_place"]`:
    write the pools' slot rows (ports new_conv / new_state bound to the pools)."""
    H, K, V, W = d["H"], d["K"], d["V"], d["W"]
    c = decode_launch_config(d["B"], H, K, V)
    lb = attrs.get("gate_lower_bound")
    launch = Launch(_kda_decode_kernel, (*_PORTS, "B", "o", "new_conv", "new_state"),
                    {"scale": float(attrs["scale"]), "eps": float(attrs["eps"]), "GATE_LB": float(lb or 0.0),
                     "H": H, "K": K, "V": V, "W": W, "BK": c["BK"], "BV": c["BV"], "BW": _np2(W), "TILES": c["TILES"],
                     "IN_PLACE": bool(attrs.get("in_place", False))},
                    grid=lambda x, n=c["TILES"]: (cdiv(x["B"] * H, n), 1, 1), scalars=lambda x: {"B": x["B"]},
                    num_warps=c["num_warps"], num_stages=1)
    return Plan((Variant("fused", (launch,)),))


_PORTS = ("qkv", "f", "b", "gate", "conv_weight", "A_log", "dt_bias", "norm_weight", "conv_pool", "state_pool",
          "slots")


def kda_decode(qkv: Tensor, f: Tensor, b: Tensor, gate: Tensor, conv_weight: Tensor, A_log: Tensor, dt_bias: Tensor,
               norm_weight: Tensor, conv_pool: Tensor, state_pool: Tensor, slots: Tensor, *, scale: float,
               eps: float, gate_lower_bound: float | None = None,
               in_place: bool = False) -> tuple[Tensor, Tensor, Tensor]:
    """Run `plan` with Triton's JIT: (o [B, H, V] in qkv's dtype, new_conv [B, C, W-1], new_state [B, H, K, V]);
    in place, the pools themselves are returned as new_conv / new_state (their slot rows written)."""
    B, H, K = f.shape
    V = gate.shape[-1]
    lo, hi = KERNEL_HEAD_DIM
    if not (lo <= K <= hi and lo <= V <= hi):
        raise ValueError(f"kda_decode (triton): needs {lo} <= K, V <= {hi}, got K={K}, V={V}")
    for name, x in (("conv_pool", conv_pool), ("state_pool", state_pool)):
        if x.dtype != torch.float32 or not x.is_contiguous():
            raise ValueError(f"kda_decode (triton): {name} must be contiguous fp32, got {x.dtype}")
    ports = dict(zip(_PORTS, (qkv, f, b, gate, conv_weight, A_log, dt_bias, norm_weight, conv_pool, state_pool,
                              slots.to(torch.int32))))
    ports = {n: x if n in ("conv_pool", "state_pool") else x.contiguous() for n, x in ports.items()}
    ports["o"] = torch.empty(B, H, V, device=qkv.device, dtype=qkv.dtype)
    if in_place:
        ports["new_conv"], ports["new_state"] = conv_pool, state_pool
    else:
        ports["new_conv"] = torch.empty(B, *conv_pool.shape[1:], device=qkv.device, dtype=torch.float32)
        ports["new_state"] = torch.empty(B, *state_pool.shape[1:], device=qkv.device, dtype=torch.float32)
    d = dims([tuple(x.shape) for x in ports.values()][:11])
    attrs = {"scale": scale, "eps": eps, "gate_lower_bound": gate_lower_bound, "in_place": in_place}
    run(plan(d, [str(qkv.dtype)], attrs), ports, d)
    return ports["o"], ports["new_conv"], ports["new_state"]
