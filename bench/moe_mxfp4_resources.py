"""Compiled resources of the MoE grouped GEMMs, packed (MXFP4) against dense, for sm_90a and sm_100a.

    python bench/moe_mxfp4_resources.py                 # K3 shapes, bf16, N = 1 (decode) and 4096 (prefill)
    python bench/moe_mxfp4_resources.py --tokens 1 16 --dtype fp32

No GPU needed: each GEMM launch of the plan (custom_ops/moe_mxfp4/triton.plan, custom_ops/moe/triton.plan) is
compiled with `triton.compile` for a `GPUTarget` (as plugins/aot.py does) and its PTX is run through the
`ptxas -v` that ships with Triton, which prints registers, spill stores and static shared memory; the
dynamic shared memory Triton reserves for the pipeline is `metadata.shared`.
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
K3 = {"E": 896, "L": 3584, "I": 3072, "d": 7168, "top_k": 16}


def ptxas(ptx: str, arch: str) -> dict:
    import triton

    exe = Path(triton.__file__).parent / "backends/nvidia/bin" / ("ptxas-blackwell" if arch >= "sm_100" else "ptxas")
    with tempfile.NamedTemporaryFile("w", suffix=".ptx", delete=False) as f:
        f.write(ptx)
    try:
        r = subprocess.run([str(exe), "-v", f"--gpu-name={arch}", f.name, "-o", os.devnull], capture_output=True,
                           text=True)
    finally:
        os.unlink(f.name)
    text = r.stdout + r.stderr
    regs, spills = re.search(r"Used (\d+) registers", text), re.search(r"(\d+) bytes spill stores", text)
    if regs is None:
        raise RuntimeError(f"ptxas {arch}: {text[-500:]}")
    return {"registers": int(regs.group(1)), "spill_stores": int(spills.group(1)) if spills else 0}


def main() -> None:
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from k3x.custom_ops.registry import Family
    from k3x.plugins import aot

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, nargs="+", default=[1, 4096])
    ap.add_argument("--dtype", default="bf16")
    a = ap.parse_args()
    print("| N | experts | kernel | arch | BM×BN×BK | warps | stages | registers | spill stores | shared (B) |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for N in a.tokens:
        dims = {"N": N, "d": K3["d"], "L": K3["L"], "E": K3["E"], "I": K3["I"]}
        for fam, wtype, nw in (("moe_mxfp4", "uint8", 6), ("moe", a.dtype, 3)):
            spec = Family(fam).plugin.SPEC
            dtypes = [a.dtype, a.dtype, a.dtype, "fp32"] + [wtype] * nw + ["int32", a.dtype]  # ..., expert_offset, u
            for sm, arch in ((90, "sm_90a"), (100, "sm_100a")):
                plan = Family(fam).triton.plan(dims, dtypes, {"top_k": K3["top_k"], "activation": "situ", "sm": sm})
                types = dict(zip([p.name for p in spec.ports], dtypes)) | {b.name: b.dtype for b in plan.workspace}
                for launch in plan.variants[0].launches:
                    if "gemm" not in launch.kernel_name:
                        continue
                    sig = aot.signature(launch, types | {n: "i32" for n in launch.scalars(dims)})
                    src = ASTSource(fn=launch.kernel, signature=sig, constexprs=dict(launch.constexprs),
                                    attrs=aot.divisibility_attrs(launch, sig))
                    ck = triton.compile(src, target=GPUTarget("cuda", sm, 32),
                                        options={"num_warps": launch.num_warps, "num_stages": launch.num_stages})
                    r, c = ptxas(ck.asm["ptx"], arch), launch.constexprs
                    print(f"| {N} | {'mxfp4' if fam == 'moe_mxfp4' else a.dtype} | {launch.kernel_name} | {arch} | "
                          f"{c['BM']}×{c['BN']}×{c['BK']} | {launch.num_warps} | {launch.num_stages} | "
                          f"{r['registers']} | {r['spill_stores']} | {ck.metadata.shared} |", flush=True)


if __name__ == "__main__":
    sys.path.insert(0, str(ROOT / ".pyshim"))
    main()
