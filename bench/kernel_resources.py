"""Compiled resources of every kernel in every family's launch plan at K3's shapes, for sm_90a and sm_100a.

    python -m k3x.bench.kernel_resources                     # both SMs, every family, markdown table
    python -m k3x.bench.kernel_resources --sm 90 --family kda --json out.json

No GPU needed: each `Launch` of `custom_ops/<family>/triton.plan(dims, dtypes, attrs)` is compiled ahead of time
exactly as the TensorRT plugin compiles it (`plugins/aot.compile_launch`: same signature, constexprs,
divisibility, warps, stages), then read back:

- registers, stack frame (ptxas' spill area) from `cuobjdump --dump-resource-usage`; spill loads/stores as
  the number of local-memory instructions (LDL/STL) in the SASS; SASS size in instructions;
- shared memory from Triton's metadata (dynamic) plus the 1 KB the driver reserves per CTA;
- CTAs per SM from registers (allocated per warp in units of 256), shared memory, warps and the CTA limit of
  the SM; waves = CTAs of the case's grid / (CTAs per SM x SMs);
- wgmma (`wgmma.mma_async` in the PTX, Hopper), tcgen05 (`tcgen05.mma`, Blackwell), block-scaled MMAs
  (`block_scale`: MXFP4/MXFP8 operands with E8M0 scales in the tensor core) and TMA (`cp.async.bulk.tensor`)
  use; `mma`: every distinct MMA instruction of the PTX (shape and operand types, e.g.
  `wgmma.mma_async.m64n16k32.f32.e4m3.e4m3`: Hopper's FP8 MMA of the W4A8 GEMMs; `tf32` operands: fp32 math
  on tensor cores where bf16 would do); `mma_sass` / `ffma`: tensor-core and fp32 FMA instructions in the SASS
  (an FMA loop where an MMA belongs shows as many FFMA beside no MMA);
- `extra`: the op call's roofline (bench/kernel_roofline.py: GFLOP, compulsory MB, FLOP per byte, which ceiling
  binds and the floor time on the SM's GPUs: H100 and H200 for sm_90a, B200 for sm_100a), to set beside the
  times gpu_check measures.

Every family has cases, the serving step's (kda_packed, kda_prep, mla_paged: `serving_cases`) included.

Which kernels a case runs is the plan's own choice (`Plan.select(dims)`), so the table follows the plan: a
variant the plan does not pick at a shape is not compiled for it. A case whose plan cannot be built (e.g. a
family's `plan` signature changed) is one row with its error, the other cases still report.
Triton's disk cache makes a second run fast; `measure` also caches per process.
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
import tempfile
from dataclasses import asdict, dataclass, field
from pathlib import Path

from .kernel_roofline import estimates


@dataclass(frozen=True)
class SM:
    """The per-SM limits that bound occupancy (CUDA occupancy rules for compute capability 9.0 / 10.0)."""
    arch: int
    name: str
    sms: int  # SMs of the bench GPU
    regs: int = 65536
    smem: int = 233472  # 228 KB shared memory per SM
    smem_reserved: int = 1024  # per CTA, reserved by the driver
    max_ctas: int = 32
    max_warps: int = 64


SMS = {90: SM(90, "H200 (sm_90a)", 132), 100: SM(100, "B200 (sm_100a)", 148)}


@dataclass(frozen=True)
class Case:
    """One shape of one family: the plan's dims, the `dtypes` list its `plan` takes, its attrs, and the
    dtype of every port (what the plugin binds)."""
    family: str
    name: str
    dims: dict
    dtypes: tuple[str, ...]
    attrs: dict
    ports: dict


@dataclass
class Resources:
    family: str
    case: str
    kernel: str
    sm: int
    warps: int = 0
    stages: int = 0
    regs: int = 0
    stack: int = 0  # bytes of stack frame (spill area)
    spill_ld: int = 0  # LDL instructions
    spill_st: int = 0  # STL instructions
    shared: int = 0  # dynamic shared memory (bytes)
    ctas_per_sm: int = 0
    limited_by: str = ""
    grid_ctas: int = 0
    waves: float = 0.0
    wgmma: bool = False
    tcgen05: bool = False
    mx_mma: bool = False  # block-scaled MMA (tcgen05 kind::mxf*, E8M0 scales applied by the tensor core)
    tma: bool = False
    mma: str = ""  # the PTX's distinct MMA instructions (`mma_kinds`)
    mma_sass: int = 0  # tensor-core instructions in the SASS (HMMA, HGMMA, QGMMA, Blackwell's UTC*MMA)
    ffma: int = 0  # fp32 FMA instructions in the SASS: many beside no MMA = an FMA loop where an MMA may belong
    sass: int = 0  # SASS instructions
    error: str = ""
    extra: dict = field(default_factory=dict)

    @property
    def spills(self) -> bool:
        return bool(self.stack or self.spill_ld or self.spill_st)


_KDA_PORTS = {"q": "bf16", "k": "bf16", "v": "bf16", "g": "fp32", "beta": "fp32", "initial_state": "fp32",
              "o": "bf16", "final_state": "fp32"}
_MOE_PORTS = {"x": "bf16", "z": "bf16", "gate_weight": "bf16", "gate_bias": "fp32", "w1": "bf16", "w3": "bf16",
              "w2": "bf16", "expert_offset": "int32", "u": "bf16"}
_MXFP4_PORTS = {n: ("uint8" if n.startswith("w") else t) for n, t in _MOE_PORTS.items()} | {
    f"w{i}_scale": "uint8" for i in (1, 3, 2)}
_AR_PORTS = {"prefix": "bf16", "bank": "bf16", "norm_weight": "fp32", "proj_weight": "fp32", "out": "bf16"}
_MOE_ATTRS = {"top_k": 16, "routed_scaling_factor": 1.0, "renormalize": True, "activation": "situ",
              "situ_beta": 4.0, "situ_linear_beta": 25.0}


def kda_case(B: int, T: int, *, H: int = 96, K: int = 128, gate_lower_bound: float | None = -5.0) -> Case:
    attrs = {"scale": K ** -0.5, "gate_lower_bound": gate_lower_bound}
    gate = "" if gate_lower_bound is not None else "-unbounded"
    head = "" if K == 128 else f"-K{K}"
    return Case("kda", f"B{B}-T{T}-H{H}{head}{gate}", {"B": B, "T": T, "H": H, "K": K, "V": K},
                ("bf16", "bf16", "bf16", "fp32", "fp32", "fp32"), attrs, _KDA_PORTS)


_DECODE_PORTS = {"qkv": "bf16", "f": "bf16", "b": "bf16", "gate": "bf16", "conv_weight": "bf16", "A_log": "fp32",
                 "dt_bias": "fp32", "norm_weight": "fp32", "conv_pool": "fp32", "state_pool": "fp32", "slots": "int32",
                 "o": "bf16", "new_conv": "fp32", "new_state": "fp32"}


def decode_case(B: int, *, H: int = 96, K: int = 128, W: int = 4) -> Case:
    """The fused KDA decode step (k3::kda_decode) at batch B: K3's heads, bf16 activations, fp32 pools."""
    return Case("kda_decode", f"B{B}-H{H}", {"B": B, "H": H, "K": K, "V": K, "W": W}, ("bf16",),
                {"scale": K ** -0.5, "eps": 1e-5, "gate_lower_bound": -5.0}, _DECODE_PORTS)


def decode_bytes(d: dict) -> dict:
    """Bytes one fused decode step moves (each read or written once) vs the recurrent state's size: the state
    read and written (fp32), the conv rows read and written (fp32), the token inputs (bf16) and o (bf16)."""
    B, H, K, V, W = d["B"], d["H"], d["K"], d["V"], d["W"]
    C = 2 * H * K + H * V
    state = B * H * K * V * 4
    moved = 2 * state + 2 * B * C * (W - 1) * 4 + B * (C + H * K + H + H * V) * 2 + B * H * V * 2
    return {"state_MB": round(state / 1e6, 2), "moved_MB": round(moved / 1e6, 2),
            "moved_vs_state": round(moved / state, 3)}


MOE_TOKENS = (1, 16, 64, 4096)  # decode batches and a prefill chunk
_PACKED_PORTS = {"q": "bf16", "k": "bf16", "v": "bf16", "g": "fp32", "beta": "fp32", "state_pool": "fp32",
                 "cu_seqlens": "int32", "slots": "int32", "o": "bf16", "final_state": "fp32"}
_PREP_PORTS = {"qkv": "bf16", "f": "bf16", "b": "bf16", "conv_weight": "bf16", "A_log": "fp32", "dt_bias": "fp32",
               "conv_pool": "fp32", "cu_seqlens": "int32", "slots": "int32", "q": "bf16", "k": "bf16", "v": "bf16",
               "g": "fp32", "beta": "fp32", "new_conv": "fp32"}
_MLA_PORTS = {"q_latent": "bf16", "q_rope": "bf16", "latent": "bf16", "latent_pool": "bf16", "block_table": "int32",
              "past_lens": "int32", "cu_seqlens": "int32", "o": "bf16"}


def serving_cases() -> list[Case]:
    """The serving step's packed / paged families at K3's heads (KDA H=96, K=V=128; MLA H=96, C=512, R=64, blocks
    of 64): a 64-sequence decode step, a 4096-token prefill chunk of one sequence; MLA decode at B=1 past 1M and
    B=32 past 16K, and a 4096-row prefill chunk after 0 and 61,440 positions (`past`: the roofline's only)."""
    kda = {"H": 96, "K": 128, "V": 128}
    lb = {"scale": 128 ** -0.5, "gate_lower_bound": -5.0}
    out = [Case("kda_packed", f"N{N}-B{B}-H96", {"N": N, "B": B} | kda, ("bf16",), lb, _PACKED_PORTS)
           for N, B in ((64, 64), (4096, 1))]
    out += [Case("kda_prep", f"N{N}-B{B}-H96", {"N": N, "B": B, "W": 4} | kda, ("bf16",), {"gate_lower_bound": -5.0},
                 _PREP_PORTS) for N, B in ((64, 64), (4096, 1))]
    for B, rows, past in ((1, 1, 1 << 20), (32, 1, 16384), (1, 4096, 0), (1, 4096, 61440)):
        MB = -(-(past + rows) // 64)
        dims = {"N": B * rows, "H": 96, "C": 512, "R": 64, "NB": B * MB, "BS": 64, "L": 576, "B": B, "MB": MB,
                "past": past}
        out.append(Case("mla_paged", f"B{B}-rows{rows}-past{past}", dims, ("bf16",), {"scale": 192 ** -0.5},
                        _MLA_PORTS))
    return out


def moe_case(N: int, *, packed: bool = False, activations: str = "bf16") -> Case:
    """K3's latent MoE at N tokens: top-16 of 896 experts, latent L = 3584, intermediate I = 3072, bf16
    activations into the experts as computed or (`activations="mxfp8"`, MXFP4 only: W4A8) quantized to MXFP8 in
    the GEMM prologues; experts bf16 (`moe`) or MXFP4 bytes (`moe_mxfp4`)."""
    dims = {"N": N, "d": 7168, "L": 3584, "E": 896, "I": 3072}
    if packed:
        a8 = activations == "mxfp8"
        return Case("moe_mxfp4", f"N{N}-k16-E896-L3584-I3072" + ("-mxfp8" if a8 else ""), dims,
                    ("bf16", "bf16", "bf16", "fp32") + ("uint8",) * 6 + ("bf16",),
                    _MOE_ATTRS | ({"activations": activations} if a8 else {}), _MXFP4_PORTS)
    return Case("moe", f"N{N}-k16-E896-L3584-I3072", dims, ("bf16", "bf16", "bf16", "fp32", "bf16", "bf16", "bf16"),
                _MOE_ATTRS, _MOE_PORTS)


def cases() -> list[Case]:
    """K3's shapes: KDA decode and prefill (B = 1 and 64, H = 96, K = V = 128, bf16, K3's gate bound), the
    unbounded-gate variant for reference, the fused KDA decode step at batch 1, 64 and 256, AttnRes over 8 bank entries at d = 7168, the latent MoE's experts
    dense, MXFP4 and MXFP4 with MXFP8 activations (W4A8) at `MOE_TOKENS` tokens (top-16 over 896 experts, latent
    3584, intermediate 3072)."""
    return [
        kda_case(1, 1), kda_case(64, 1), kda_case(1, 4096), kda_case(64, 4096),
        kda_case(1, 4096, gate_lower_bound=None), decode_case(1), decode_case(64), decode_case(256),
        Case("attn_res", "R4096-N8-d7168", {"R": 4096, "N": 8, "d": 7168}, ("bf16", "bf16", "fp32", "fp32"),
             {"eps": 1e-6}, _AR_PORTS),
        *(moe_case(N, packed=p) for p in (False, True) for N in MOE_TOKENS),
        *(moe_case(N, packed=True, activations="mxfp8") for N in MOE_TOKENS),
        *serving_cases(),
    ]


def occupancy(regs: int, shared: int, warps: int, sm: SM) -> tuple[int, str]:
    """CTAs per SM and the resource that bounds them."""
    per_warp = -(-max(regs, 1) * 32 // 256) * 256
    limits = {
        "regs": (sm.regs // per_warp) // warps,
        "smem": sm.smem // (shared + sm.smem_reserved),
        "warps": sm.max_warps // warps,
        "ctas": sm.max_ctas,
    }
    name = min(limits, key=lambda k: limits[k])
    return limits[name], name


def _tool(name: str) -> str:
    import triton

    return str(Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / name)


_MMA = re.compile(r"\b(?:wgmma\.mma_async|tcgen05\.mma|mma\.sync)[\w.:]*")


def mma_kinds(ptx: str) -> str:
    """The distinct MMA instructions of a PTX (".sync.aligned" dropped), sorted, comma-separated."""
    return ",".join(sorted({m.group(0).replace(".sync.aligned", "") for m in _MMA.finditer(ptx)}))


def read_cubin(cubin: bytes, ptx: str, kernel: str) -> dict:
    """Registers, stack, LDL/STL and SASS instruction counts of one cubin; MMA kinds and TMA from its PTX."""
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        usage = subprocess.run([_tool("cuobjdump"), "--dump-resource-usage", f.name], capture_output=True,
                               text=True, check=True).stdout
        sass = subprocess.run([_tool("cuobjdump"), "-sass", f.name], capture_output=True, text=True,
                              check=True).stdout
    m = re.search(r"REG:(\d+)\s+STACK:(\d+)", usage)
    if m is None:
        raise RuntimeError(f"{kernel}: no resource usage in cuobjdump's output")
    instrs = re.findall(r"/\*[0-9a-f]{4,}\*/\s+([A-Z][A-Z0-9_.]*)", sass)
    ops = [i.split(".")[0] for i in instrs]
    return {"regs": int(m.group(1)), "stack": int(m.group(2)), "spill_ld": ops.count("LDL"),
            "spill_st": ops.count("STL"), "sass": len(instrs), "ffma": ops.count("FFMA"),
            "mma_sass": sum(ops.count(o) for o in ("HMMA", "HGMMA", "QGMMA", "UTCHMMA", "UTCQMMA", "UTCOMMA")), "wgmma": "wgmma.mma_async" in ptx,
            "tcgen05": "tcgen05.mma" in ptx, "mx_mma": "block_scale" in ptx, "tma": "cp.async.bulk.tensor" in ptx,
            "mma": mma_kinds(ptx)}


def _types(case: Case, plan, launch) -> dict:
    return dict(case.ports) | {b.name: b.dtype for b in plan.workspace} | {n: "i32" for n in launch.scalars(case.dims)}


_MEASURED: dict[tuple, Resources] = {}


def measure_launch(case: Case, plan, launch, sm: SM) -> Resources:
    """Compile one launch of `case`'s plan for `sm` and read its resources."""
    from k3x.plugins import aot

    key = (case.family, case.name, repr(case.dims), launch.kernel_name, repr(sorted(launch.constexprs.items())),
           launch.num_warps, launch.num_stages, sm.arch)
    if key in _MEASURED:
        return _MEASURED[key]
    r = Resources(case.family, case.name, launch.kernel_name, sm.arch, warps=launch.num_warps,
                  stages=launch.num_stages)
    try:
        ck = aot.compile_launch(launch, _types(case, plan, launch), sm.arch, keep_ptx=True)
        for k, v in read_cubin(ck.cubin, ck.ptx, ck.name).items():
            setattr(r, k, v)
        r.shared = ck.shared
        r.ctas_per_sm, r.limited_by = occupancy(r.regs, r.shared, r.warps, sm)
        g = [int(x) for x in launch.grid(case.dims)]
        r.grid_ctas = g[0] * (g[1] if len(g) > 1 else 1) * (g[2] if len(g) > 2 else 1)
        r.waves = round(r.grid_ctas / max(r.ctas_per_sm * sm.sms, 1), 2)
        r.extra = (decode_bytes(case.dims) if case.family == "kda_decode" else {}) | roofline(case, sm.arch)
    except Exception as e:  # noqa: BLE001 - one row per failure, the table goes on
        r.error = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"[:200]
    _MEASURED[key] = r
    return r


def roofline(case: Case, sm: int) -> dict:
    """The op call's FLOPs, compulsory bytes and floor time on the GPUs of `sm` (bench/kernel_roofline.py)."""
    try:
        return estimates(case.family, case.dims, case.attrs, sm)
    except KeyError:
        return {}


def family_plan(case: Case, sm: int = 90):
    """The family's plan at the case's dims for target `sm` (attrs["sm"], as the TensorRT plugin passes it)."""
    import importlib

    mod = importlib.import_module(f"k3x.custom_ops.{case.family}.triton")
    return mod.plan(dict(case.dims), list(case.dtypes), dict(case.attrs) | {"sm": sm})


def measure_case(case: Case, sm: SM, *, kernels: tuple[str, ...] | None = None) -> list[Resources]:
    """Every launch the plan picks at `case.dims` (or only those named in `kernels`)."""
    try:
        plan = family_plan(case, sm.arch)
        launches = plan.select(case.dims).launches
    except Exception as e:  # noqa: BLE001
        return [Resources(case.family, case.name, "(plan)", sm.arch, error=f"{type(e).__name__}: {e}"[:200])]
    return [measure_launch(case, plan, x, sm) for x in launches if kernels is None or x.kernel_name in kernels]


COLUMNS = ("family", "case", "kernel", "sm", "warps", "stages", "regs", "stack", "spill_ld", "spill_st", "shared",
           "ctas_per_sm", "limited_by", "grid_ctas", "waves", "wgmma", "tcgen05", "mx_mma", "tma",
           "mma", "mma_sass", "ffma", "sass", "extra")


def markdown(rows: list[Resources]) -> str:
    head = "| " + " | ".join(COLUMNS) + " |\n|" + "---|" * len(COLUMNS) + "\n"
    lines = []
    for r in rows:
        if r.error:
            lines.append(f"| {r.family} | {r.case} | {r.kernel} | {r.sm} | error: {r.error} |" + " |" * (len(COLUMNS) - 5))
            continue
        d = asdict(r)
        lines.append("| " + " | ".join(str(d[c]) for c in COLUMNS) + " |")
    return head + "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sm", type=int, nargs="+", default=[90, 100], choices=sorted(SMS))
    ap.add_argument("--family", nargs="+", default=None, help="only these families (default: all)")
    ap.add_argument("--kernel", default=None, help="only kernels whose name contains this (e.g. gemm)")
    ap.add_argument("--json", type=Path, default=None, help="also write the rows as JSON here")
    a = ap.parse_args(argv)
    rows = [r for sm in a.sm for c in cases() if a.family is None or c.family in a.family
            for r in measure_case(c, SMS[sm]) if a.kernel is None or a.kernel in r.kernel or r.error]
    print(markdown(rows))
    if a.json is not None:
        a.json.write_text(json.dumps([asdict(r) for r in rows], indent=1))
    return 1 if any(r.error for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
