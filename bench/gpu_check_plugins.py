"""GPU check for the TensorRT plugins' AOT path, without TensorRT: launch the exact cubins a plugin embeds.

For each plugin's AOT plan (KDA decode, KDA chunked prefill, AttnRes, MoE's eight kernels), in bf16 on the GPU:
  1. plan at a profile "opt" shape that differs from the run shape (grids and scalars must follow the
     runtime dims, constexprs were chosen at opt, as in an engine);
  2. compile the plan for this GPU's SM with `trt.adapter.compile_plan`, `aot.pack` -> `aot.unpack`
     (the bytes the engine stores in the `k3_kernels` field);
  3. launch through `trt.adapter.run_plan` + `aot.CudaDriver` (libcuda cuModuleLoadData / cuLaunchKernel)
     with torch-allocated I/O and a workspace of `workspace_layout` size plus the TMA scratch (`scratch_size`)
     — the code `enqueue` runs;
  4. compare with the fp32 eager reference under tests/tolerances.py (MoE: also bitwise equal over two runs —
     no atomics in its output path).
Registered in bench/gpu_check.py's `CHECKS`; skipped (info) in the CPU self-test, which has no driver.

No onnx on this path: a family's `plugin.py` imports its `onnx.py` (the node spec = the plugin fields), and the
GPU machine has no onnx. The launch needs only what `trt.adapter.compile_plan` / `run_plan` read of a
`PluginSpec` (its ports in order, `dims`, `plan`), so `launch_specs` builds that from each family's
`triton.py` and the port names below; tests/bench/test_gpu_check_imports.py checks them against the real
specs where onnx is installed.
"""

from __future__ import annotations

import importlib
import sys
from dataclasses import dataclass
from typing import Any, Callable

# plugin op_type -> (family, input ports, output ports), in the order of custom_ops/<family>/plugin.py's SPEC
PORTS = {
    "KDA": ("kda", ("q", "k", "v", "g", "beta", "initial_state"), ("o", "final_state")),
    "AttnRes": ("attn_res", ("prefix", "bank", "norm_weight", "proj_weight"), ("out",)),
    "MoE": ("moe", ("x", "z", "gate_weight", "gate_bias", "w1", "w3", "w2", "expert_offset"), ("u",)),
}


@dataclass(frozen=True)
class LaunchSpec:
    """The part of a `PluginSpec` the AOT launch path reads."""
    name: str
    inputs: tuple
    ports: tuple
    dims: Callable[[list], dict]
    plan: Callable[..., Any]


def imports() -> dict:
    """Every module the plugin check uses (torch, triton, k3x's references, plugins.aot/adapter/core): no onnx."""
    from k3x.custom_ops.attn_res import reference as ar_ref
    from k3x.custom_ops.kda import reference as kda_ref
    from k3x.custom_ops.moe import reference as moe_ref
    from k3x.plan.dtypes import FLOAT, dtype_name
    from k3x.plan.launch import workspace_layout
    from k3x.plugins import aot
    from k3x.plugins.adapter import compile_plan, run_plan, scratch_size
    from k3x.plugins.core import Port

    return dict(ar_ref=ar_ref, kda_ref=kda_ref, moe_ref=moe_ref, aot=aot, compile_plan=compile_plan,
                run_plan=run_plan, scratch_size=scratch_size, workspace_layout=workspace_layout,
                dtype_name=dtype_name, Port=Port, FLOAT=FLOAT)


def launch_specs() -> dict[str, LaunchSpec]:
    m = imports()
    out = {}
    for name, (family, ins, outs) in PORTS.items():
        kt = importlib.import_module(f"k3x.custom_ops.{family}.triton")
        ports = tuple(m["Port"](n, m["FLOAT"]) for n in ins + outs)
        out[name] = LaunchSpec(name, ports[:len(ins)], ports, kt.dims, kt.plan)
    return out


def plugin_aot_kernels(ctx) -> list:
    gc = sys.modules[type(ctx).__module__]  # bench/gpu_check.py, whether run as __main__ or imported
    if ctx.selftest:
        return [gc.Result("plugin AOT cubins", "info", None, note="needs the CUDA driver; skipped in self-test")]
    import torch

    m = imports()
    ar_ref, kda_ref, moe_ref, aot = m["ar_ref"], m["kda_ref"], m["moe_ref"], m["aot"]
    compile_plan, run_plan, workspace_layout, dtype_name = (m["compile_plan"], m["run_plan"], m["workspace_layout"],
                                                            m["dtype_name"])
    major, minor = torch.cuda.get_device_capability()
    sm = major * 10 + minor
    driver, out, S = aot.CudaDriver(), [], launch_specs()

    def launch(spec, opt_dims, tensors, attrs):
        dtypes = [dtype_name(t.dtype) for t in tensors]
        shapes = [tuple(t.shape) for t in tensors]
        run_dims = spec.dims(shapes[:len(spec.inputs)])
        plan = spec.plan(opt_dims, dtypes, attrs | {"sm": sm})  # as the plugin plans for its target
        kernels = compile_plan(spec, plan, dtypes, sm, [opt_dims, run_dims])
        _, embedded = aot.unpack(aot.pack(kernels, {"sm": sm}))
        size = workspace_layout(plan.workspace, run_dims)[1] + m["scratch_size"](spec, plan, embedded, dtypes,
                                                                                 run_dims, sm)  # + TMA scratch
        ws = torch.empty(max(size, 256), dtype=torch.uint8, device="cuda")
        stream = torch.cuda.current_stream().cuda_stream
        run_plan(spec, plan, embedded, driver, shapes, dtypes, [t.data_ptr() for t in tensors], ws.data_ptr(),
                 stream, sm)
        torch.cuda.synchronize()
        return {"kernels": ",".join(k.name for k in kernels), "sm": sm}

    kda = S["KDA"]
    H, K, V = 8, 128, 128
    for B, T, opt_T in ((4, 1, 1), (2, 300, 128), (1, 16, 1)):
        if ctx.time_left() < 5:
            return out + [gc.Result("plugin AOT cubins", "info", None, note=f"stopped at KDA B{B}-T{T}: section budget")]
        q, k, v, g, beta, h0 = gc._kda_inputs(B, T, H, K, V, torch.bfloat16, "cuda")
        beta = beta.float()
        o = torch.full((B, T, H, V), float("nan"), dtype=torch.bfloat16, device="cuda")
        s = torch.full((B, H, K, V), float("nan"), device="cuda")
        info = launch(kda, dict(B=1, T=opt_T, H=H, K=K, V=V), [q, k, v, g, beta, h0, o, s],
                      {"scale": K ** -0.5, "gate_lower_bound": -5.0})
        ro, rs = kda_ref.kda_chunked(*(x.float() for x in (q, k, v, g, beta)), initial_state=h0)
        out.append(gc._compare(f"plugin KDA o B{B}-T{T}", o, ro, torch.bfloat16, info))
        out.append(gc._compare(f"plugin KDA state B{B}-T{T}", s, rs, torch.bfloat16))
    if ctx.time_left() < 5:
        return out + [gc.Result("plugin AOT cubins", "info", None, note="stopped before AttnRes: section budget")]
    ar = S["AttnRes"]
    for R, N, d in ((256, 8, 7168), (5, 3, 1000)):
        prefix = (torch.randn(R, d, device="cuda") * 4).bfloat16()
        bank = torch.randn(R, N, d, device="cuda").bfloat16()
        nw, pw = 1 + 0.1 * torch.randn(d, device="cuda"), torch.randn(d, device="cuda") * 0.05
        y = torch.full((R, d), float("nan"), dtype=torch.bfloat16, device="cuda")
        info = launch(ar, dict(R=64, N=N, d=d), [prefix, bank, nw, pw, y], {"eps": 1e-5})
        out.append(gc._compare(f"plugin AttnRes R{R}-N{N}-d{d}", y, ar_ref.attn_res(prefix, bank, nw, pw, 1e-5),
                               torch.bfloat16, info))
    moe = S["MoE"]
    attrs = {"top_k": 0, "routed_scaling_factor": 2.5, "renormalize": 1, "activation": "situ", "situ_beta": 4.0,
             "situ_linear_beta": 25.0}
    for N, opt_N, d, L, I, E, k, hot in ((512, 16, 512, 384, 256, 64, 8, None),  # prefill planned at decode BM
                                         (300, 300, 256, 384, 192, 7, 7, 2),  # top_k = E, one overloaded expert
                                         (5, 64, 7168, 512, 384, 896, 16, None)):  # decode at K3's E, d
        if ctx.time_left() < 5:
            return out + [gc.Result("plugin AOT cubins", "info", None, note=f"stopped at MoE N{N}: section budget")]
        dev, bf = "cuda", torch.bfloat16
        x, z = torch.randn(N, d, device=dev).to(bf), torch.randn(N, L, device=dev).to(bf)
        gw, gb = (torch.randn(E, d, device=dev) * d ** -0.5).to(bf), torch.randn(E, device=dev) * 0.1
        if hot is not None:
            gb[hot] = 100.0
        w1, w3 = ((torch.randn(E, I, L, device=dev) * L ** -0.5).to(bf) for _ in range(2))
        w2 = (torch.randn(E, L, I, device=dev) * I ** -0.5).to(bf)
        a = attrs | {"top_k": k}
        runs = []
        for _ in range(2):
            u = torch.full((N, L), float("nan"), dtype=bf, device=dev)
            off = torch.zeros(1, dtype=torch.int32, device=dev)  # expert_offset: one GPU
            info = launch(moe, dict(N=opt_N, d=d, L=L, E=E, I=I), [x, z, gw, gb, w1, w3, w2, off, u], a)
            runs.append(u)
        tag = f"N{N}-opt{opt_N}-E{E}-k{k}" + ("" if hot is None else f"-hot{hot}")
        want = moe_ref.moe(x, z, gw, gb, w1, w3, w2, k, 2.5, True, "situ", 4.0, 25.0)
        out.append(gc._compare(f"plugin MoE u {tag}", runs[0], want, torch.bfloat16, info))
        same = torch.equal(runs[0].view(torch.int16), runs[1].view(torch.int16))
        out.append(gc.Result(f"plugin MoE deterministic {tag}", "parity", same, note="two runs bitwise equal"))
    return out
