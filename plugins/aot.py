"""Ahead-of-time Triton: compile a plugin's launches to cubin/PTX for one SM (no GPU needed), pack them into
the bytes a plugin serialises into the engine, and launch them through the CUDA driver (ctypes `libcuda`,
no Triton, no torch) at run time.

`triton.compile(ASTSource(...), target=GPUTarget("cuda", sm, 32))` works on a CPU-only machine (docs/model.md §8).
Specialised arguments (`Launch.constexprs` naming a non-constexpr parameter, e.g. KDA's `scale`) are baked
into the code. Like Triton's JIT, every pointer and every int32 the plan declares a multiple of 16
(`Launch.divisible`) is compiled with `tt.divisibility=16` (without it loads are not vectorised, `cp.async`
pipelining is off and the MoE GEMMs spill); `CudaDriver.launch` refuses values that break the promise.
The PTX entry of Triton >= 3.3 kernels has trailing scratch-pointer parameters (global, profile scratch): a
kernel that creates TMA descriptors on the device (`tl.make_tensor_descriptor`) needs `scratch` bytes of global
memory per program, which the plugin carves out of its TensorRT workspace (adapter.run_plan) and passes as the
first; profile scratch is always null (kernels needing it are refused).
"""

from __future__ import annotations

import ctypes
import hashlib
import json
import re
import struct
import zlib
from dataclasses import asdict, dataclass

from ..plan.dtypes import TRITON_POINTER
from ..plan.launch import Launch
from .core import PluginError

MAGIC = b"K3AOT2\0\0"  # the cubins zlib-compressed (K3AOT1: raw, still read)
_RAW_MAGIC = b"K3AOT1\0\0"


@dataclass(frozen=True)
class CompiledKernel:
    key: str  # kernel name + hash of signature/constexprs/options/SM
    name: str  # PTX entry name
    sm: int
    arg_names: tuple[str, ...]  # runtime (non-constexpr) arguments, in order
    arg_types: tuple[str, ...]  # triton types: "*bf16", "i32", ...
    n_params: int  # PTX parameters incl. the trailing scratch pointers
    num_warps: int
    shared: int  # bytes of dynamic shared memory
    cubin: bytes
    ptx: str = ""
    divisible: tuple[str, ...] = ()  # runtime args compiled as multiples of 16 (bytes for pointers)
    scratch: int = 0  # bytes of global scratch per program (device-side TMA descriptors), 128-byte aligned

    @property
    def block(self) -> tuple[int, int, int]:
        return (self.num_warps * 32, 1, 1)

    def describe(self) -> dict:
        d = asdict(self)
        d.pop("cubin"), d.pop("ptx")
        return d | {"cubin_bytes": len(self.cubin)}


def signature(launch: Launch, types: dict[str, str]) -> dict[str, str]:
    """Triton signature for every kernel parameter. The kernel's runtime (non-constexpr) parameters take
    `launch.args` in order; `types` maps each arg to a core dtype (tensors) or "i32" (scalars). Constexprs
    and specialised parameters (named in `launch.constexprs`) are "constexpr"."""
    runtime = [p for p in launch.kernel.arg_names if p not in launch.constexprs]
    if len(runtime) != len(launch.args):
        raise PluginError(f"{launch.kernel_name}: launch args {launch.args} do not match the kernel's runtime "
                          f"parameters {tuple(runtime)}")
    bound = dict(zip(runtime, launch.args))
    sig = {}
    for p in launch.kernel.arg_names:
        if p in launch.constexprs:
            sig[p] = "constexpr"
        else:
            t = types[bound[p]]
            sig[p] = t if t == "i32" else TRITON_POINTER[t]
    return sig


def divisible_args(launch: Launch, sig: dict[str, str]) -> tuple[str, ...]:
    """Runtime args compiled with `tt.divisibility=16`: every pointer and the scalars in `launch.divisible`."""
    runtime = [p for p in launch.kernel.arg_names if p not in launch.constexprs]
    bound = dict(zip(runtime, launch.args))
    unknown = set(launch.divisible) - {a for p, a in bound.items() if sig[p] == "i32"}
    if unknown:
        raise PluginError(f"{launch.kernel_name}: divisible={sorted(unknown)} are not int32 scalar args")
    return tuple(a for p, a in bound.items() if sig[p].startswith("*") or a in launch.divisible)


def divisibility_attrs(launch: Launch, sig: dict[str, str]) -> dict:
    """`ASTSource(attrs=...)`: {(param index,): [["tt.divisibility", 16]]}, the form Triton's JIT builds."""
    div = set(divisible_args(launch, sig))
    runtime = [p for p in launch.kernel.arg_names if p not in launch.constexprs]
    bound = dict(zip(runtime, launch.args))
    return {(i,): [["tt.divisibility", 16]] for i, p in enumerate(launch.kernel.arg_names)
            if p in bound and bound[p] in div}


def check_divisible(k: CompiledKernel, values: dict[str, int]) -> None:
    """Refuse a launch whose pointers / declared sizes are not multiples of 16, as `k` was compiled to assume."""
    bad = [f"{a}={int(values[a]):#x}" for a in k.divisible if int(values[a]) % 16]
    if bad:
        raise PluginError(f"{k.name}: compiled for 16-divisible {', '.join(k.divisible)}, got {', '.join(bad)}")


def launch_key(launch: Launch, sig: dict[str, str], sm: int) -> str:
    blob = json.dumps([sig, {k: repr(v) for k, v in launch.constexprs.items()}, launch.num_warps,
                       launch.num_stages, sm, divisible_args(launch, sig)], sort_keys=True)
    return f"{launch.kernel_name}:{hashlib.sha1(blob.encode()).hexdigest()[:16]}"


_CACHE: dict[str, CompiledKernel] = {}


def compile_launch(launch: Launch, types: dict[str, str], sm: int, *, keep_ptx: bool = False) -> CompiledKernel:
    """Compile one launch for `sm` (cached per process; Triton's disk cache also applies)."""
    sig = signature(launch, types)
    key = launch_key(launch, sig, sm)
    if key in _CACHE and (_CACHE[key].ptx or not keep_ptx):
        return _CACHE[key]
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    src = ASTSource(fn=launch.kernel, signature=sig, constexprs=dict(launch.constexprs),
                    attrs=divisibility_attrs(launch, sig))
    ck = triton.compile(src, target=GPUTarget("cuda", sm, 32),
                        options={"num_warps": launch.num_warps, "num_stages": launch.num_stages})
    md = ck.metadata
    scratch = int(getattr(md, "global_scratch_size", 0) or 0)
    if scratch and int(getattr(md, "global_scratch_align", 1)) > SCRATCH_ALIGN:
        raise PluginError(f"{launch.kernel_name}: global scratch aligned to {md.global_scratch_align} B, the "
                          f"launcher gives {SCRATCH_ALIGN}")
    if getattr(md, "profile_scratch_size", 0):
        raise PluginError(f"{launch.kernel_name}: needs profile scratch, which the plugin launcher does not provide")
    ptx = ck.asm["ptx"]
    entry = re.search(r"\.entry\s+" + re.escape(md.name) + r"\((.*?)\)", ptx, re.S)
    n_params = entry.group(1).count(".param") if entry else len(launch.args)
    out = CompiledKernel(key=key, name=md.name, sm=sm, arg_names=launch.args,
                         arg_types=tuple(sig[p] for p in launch.kernel.arg_names if p not in launch.constexprs), n_params=n_params,
                         num_warps=md.num_warps, shared=md.shared, cubin=bytes(ck.asm["cubin"]),
                         ptx=ptx if keep_ptx else "", divisible=divisible_args(launch, sig), scratch=scratch)
    _CACHE[key] = out
    return out


SCRATCH_ALIGN = 128  # Triton's global scratch alignment (device-side TMA descriptors: 128 B per program)


def scratch_bytes(k: CompiledKernel, grid) -> int:
    """Global scratch a launch of `k` on `grid` needs: one `k.scratch` slot per program, as Triton's launcher
    allocates it (the kernel indexes it by its linear program id)."""
    n = 1
    for g in grid:
        n *= int(g)
    return k.scratch * n


# ------------------------------------------------------------------------------------- engine-embedded bundle

def pack(kernels: list[CompiledKernel], meta: dict) -> bytes:
    """MAGIC | u32 header length | JSON header (meta + kernels) | zlib(cubins back to back).
    Compressed because TensorRT serialises every plugin instance's fields (twice): each layer of an engine
    carries its family's kernels, which were 7 % of the k3-bench engine raw (cubins shrink to ~30 %)."""
    heads, blobs, off = [], [], 0
    for k in kernels:
        heads.append(k.describe() | {"offset": off})
        blobs.append(k.cubin)
        off += len(k.cubin)
    header = json.dumps({"meta": meta, "kernels": heads}, sort_keys=True).encode()
    return MAGIC + struct.pack("<I", len(header)) + header + zlib.compress(b"".join(blobs), 9)


def unpack(data: bytes) -> tuple[dict, dict[str, CompiledKernel]]:
    if data[:8] not in (MAGIC, _RAW_MAGIC):
        raise PluginError("serialized plugin kernels: bad magic (engine from another k3x version?)")
    (n,) = struct.unpack("<I", data[8:12])
    header = json.loads(data[12:12 + n])
    base = 12 + n
    if data[:8] == MAGIC:
        try:
            data, base = zlib.decompress(data[base:]), 0
        except zlib.error as e:
            raise PluginError(f"serialized plugin kernels: corrupt cubin section ({e})") from None
    kernels = {}
    for h in header["kernels"]:
        cubin = data[base + h["offset"]: base + h["offset"] + h["cubin_bytes"]]
        kernels[h["key"]] = CompiledKernel(key=h["key"], name=h["name"], sm=h["sm"], arg_names=tuple(h["arg_names"]),
                                           arg_types=tuple(h["arg_types"]), n_params=h["n_params"],
                                           num_warps=h["num_warps"], shared=h["shared"], cubin=cubin,
                                           divisible=tuple(h.get("divisible", ())), scratch=h.get("scratch", 0))
    return header["meta"], kernels


# ------------------------------------------------------------------------------------- CUDA driver launcher

class CudaDriver:
    """The few `libcuda` calls a plugin needs: load a cubin, get its function, launch it on a stream."""

    def __init__(self) -> None:
        try:
            self.lib = ctypes.CDLL("libcuda.so.1")
        except OSError as e:
            raise PluginError(f"libcuda.so.1 not loadable ({e}): the AOT plugin path needs an NVIDIA driver") from e
        self._functions: dict[str, ctypes.c_void_p] = {}

    def _check(self, rc: int, what: str) -> None:
        if rc != 0:
            msg = ctypes.c_char_p()
            self.lib.cuGetErrorString(rc, ctypes.byref(msg))
            raise RuntimeError(f"{what}: CUDA error {rc} ({(msg.value or b'?').decode()})")

    def function(self, k: CompiledKernel) -> ctypes.c_void_p:
        if k.key not in self._functions:
            mod, fn = ctypes.c_void_p(), ctypes.c_void_p()
            self._check(self.lib.cuModuleLoadData(ctypes.byref(mod), ctypes.c_char_p(k.cubin)),
                        f"cuModuleLoadData({k.name}, sm_{k.sm})")
            self._check(self.lib.cuModuleGetFunction(ctypes.byref(fn), mod, k.name.encode()), f"cuModuleGetFunction({k.name})")
            if k.shared > 49152:  # CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES
                self._check(self.lib.cuFuncSetAttribute(fn, 8, ctypes.c_int(k.shared)), f"cuFuncSetAttribute({k.name})")
            self._functions[k.key] = fn
        return self._functions[k.key]

    def launch(self, k: CompiledKernel, grid: tuple, values: dict[str, int], stream: int, scratch: int = 0) -> None:
        """`values`: device pointers (ints) for tensor args, ints for i32 scalars, by argument name; `scratch`:
        device pointer to `scratch_bytes(k, grid)` bytes (SCRATCH_ALIGN-aligned) when `k.scratch`."""
        grid = tuple(int(g) for g in grid) + (1,) * (3 - len(grid))
        if min(grid) <= 0:
            return  # empty tensor: nothing to do
        check_divisible(k, values)
        if k.scratch and (not scratch or scratch % SCRATCH_ALIGN):
            raise PluginError(f"{k.name}: needs {k.scratch} B of global scratch per program, got {scratch:#x}")
        cargs = [ctypes.c_int32(int(values[a])) if t == "i32" else ctypes.c_uint64(int(values[a]))
                 for a, t in zip(k.arg_names, k.arg_types)]
        n_trailing = k.n_params - len(cargs)  # Triton's global and profile scratch pointers
        cargs += [ctypes.c_uint64(p) for p in ([scratch if k.scratch else 0] + [0] * n_trailing)[:n_trailing]]
        params = (ctypes.c_void_p * len(cargs))(*[ctypes.cast(ctypes.pointer(c), ctypes.c_void_p) for c in cargs])
        self._check(self.lib.cuLaunchKernel(self.function(k), *grid, *k.block, k.shared, ctypes.c_void_p(stream),
                                            params, None), f"cuLaunchKernel({k.name}, grid={grid})")
