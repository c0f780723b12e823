"""Launch plans: how an op family's Triton kernels run, written once and executed two ways.

A family's `triton.py` has `plan(dims, dtypes, attrs) -> Plan`: its kernels as `Launch`es (kernel,
argument order, constexprs, warps, stages) chosen for one concrete set of dims, each launch's grid and int32
scalar arguments as functions of the runtime dims, and the workspace buffers. The same `Plan` object is run

- by `run(plan, tensors, dims)` below: Triton's JIT on torch tensors (the op's `triton` kernels, the
  TensorRT plugins' `jit` path), workspace allocated as torch tensors;
- by `k3x.plugins.adapter.run_plan`: the plan's cubins, compiled ahead of time, through the CUDA driver
  inside a TensorRT engine, workspace carved out of TensorRT's allocation.

Nothing here imports torch, Triton or TensorRT at module level, so plans can be built and checked on any
machine. Dims are dicts of named sizes (`{"B": 2, "T": 7, ...}`); grid and scalar functions use only
`+ * //` and `cdiv`, so they evaluate on ints and on TensorRT's symbolic shape expressions alike.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Sequence

from .dtypes import ITEMSIZE, torch_dtype


@dataclass(frozen=True)
class Buffer:
    """A workspace buffer: `numel(dims)` elements of `dtype` (a k3x dtype name, see dtypes.py)."""
    name: str
    dtype: str
    numel: Callable[[dict], Any]


@dataclass(frozen=True)
class Launch:
    """One kernel launch. `args` are, in the kernel's order of runtime parameters, port names, workspace
    buffer names or int32 scalar names (`scalars(dims)` gives their values); `constexprs` also pin specialised
    arguments. `divisible` names the int32 scalars the plan guarantees to be multiples of 16 (AOT compiles
    them with `tt.divisibility=16`, as Triton's JIT does for such values, and checks them at every launch)."""
    kernel: Any  # triton.JITFunction
    args: tuple[str, ...]
    constexprs: dict
    grid: Callable[[dict], tuple]
    scalars: Callable[[dict], dict] = lambda d: {}
    num_warps: int = 4
    num_stages: int = 1
    divisible: tuple[str, ...] = ()

    @property
    def kernel_name(self) -> str:
        return self.kernel.fn.__name__ if hasattr(self.kernel, "fn") else self.kernel.__name__


@dataclass(frozen=True)
class Variant:
    """Launches run in order when `when(dims)` holds for the runtime dims (first match wins)."""
    name: str
    launches: tuple[Launch, ...]
    when: Callable[[dict], bool] = lambda d: True


class PlanError(ValueError):
    """No variant of a plan covers the given dims, or a launch cannot be bound."""


@dataclass(frozen=True)
class Plan:
    variants: tuple[Variant, ...]
    workspace: tuple[Buffer, ...] = ()

    def select(self, dims: dict) -> Variant:
        for v in self.variants:
            if v.when(dims):
                return v
        raise PlanError(f"no kernel variant covers dims {dims}")


SM90_SMS = 132  # H200: the SM count launch configurations are sized for
SM90_REGS, SM90_SMEM, SM90_SMEM_RESERVED, SM90_MAX_WARPS = 65536, 233472, 1024, 64


def ctas_per_sm(regs: int, shared: int, warps: int) -> int:
    """Co-resident CTAs on one sm_90 SM: registers (allocated per warp in units of 256), shared memory
    (+ 1 KB reserved per CTA), warps."""
    per_warp = -(-regs * 32 // 256) * 256
    return min((SM90_REGS // per_warp) // warps, SM90_SMEM // (shared + SM90_SMEM_RESERVED),
               SM90_MAX_WARPS // warps)


def device_sm(device) -> int:
    """The SM of a CUDA device as 10·major + minor (90, 100, ...); 90 elsewhere (the interpreter). Plans take it
    as attrs["sm"] where a kernel choice depends on the target."""
    import torch

    if getattr(device, "type", str(device)) != "cuda":
        return 90
    major, minor = torch.cuda.get_device_capability(device)
    return 10 * major + minor


def cdiv(a, b):
    """Ceil division on ints and on symbolic shape expressions alike."""
    return (a + b - 1) // b


def workspace_layout(buffers: Sequence[Buffer], dims: dict, align: int = 256) -> tuple[list[int], int]:
    """Byte offsets of each buffer inside one workspace allocation, and its total size."""
    offsets, total = [], 0
    for b in buffers:
        offsets.append(total)
        total += cdiv(int(b.numel(dims)) * ITEMSIZE[b.dtype], align) * align
    return offsets, total


def _scratch_allocator(device) -> None:
    """Kernels that build TMA descriptors on the device need global scratch, which Triton's JIT allocates through
    `triton.set_allocator` (a context variable, unset in a fresh thread): torch bytes on `device` unless set."""
    import torch
    import triton
    from triton.runtime import _allocation

    if _allocation._allocator.get() is getattr(_allocation, "_NULL_ALLOCATOR", None):
        triton.set_allocator(lambda size, align, stream: torch.empty(size, dtype=torch.int8, device=device))


def run(plan: Plan, tensors: dict, dims: dict, *, only: Sequence[str] | None = None) -> dict:
    """Execute the variant of `plan` for `dims` with Triton's JIT on torch tensors; returns every tensor by
    name (ports and workspace). `only`: run just the launches of these kernel names (a step of a plan, e.g.
    MoE's routing); workspace buffers given in `tensors` are used as they are, the others allocated."""
    import torch

    launches = [x for x in plan.select(dims).launches if only is None or x.kernel_name in only]
    used = {a for x in launches for a in x.args}
    device = next(iter(tensors.values())).device
    if device.type == "cuda":
        _scratch_allocator(device)
    env = dict(tensors)
    for b in plan.workspace:
        if b.name in used and b.name not in env:
            env[b.name] = torch.empty(int(b.numel(dims)), dtype=torch_dtype(b.dtype), device=device)
    for x in launches:
        grid = tuple(int(g) for g in x.grid(dims))
        if min(grid) <= 0:
            continue  # empty tensor: nothing to do
        values = env | x.scalars(dims)
        runtime = [p for p in x.kernel.arg_names if p not in x.constexprs]
        if len(runtime) != len(x.args):
            raise PlanError(f"{x.kernel_name}: launch args {x.args} do not match its runtime parameters {runtime}")
        kwargs = {p: values[a] for p, a in zip(runtime, x.args)} | dict(x.constexprs)
        x.kernel[grid](**kwargs, num_warps=x.num_warps, num_stages=x.num_stages)
    return env
