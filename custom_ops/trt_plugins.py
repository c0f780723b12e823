"""Every op family's TensorRT plugin: the specs, their IPluginV3 creators and their QDP forms (the registry
iterated over the TensorRT plumbing in `plugins/`, which knows no family)."""

from __future__ import annotations

from ..plugins.core import PluginError, PluginSpec


def specs() -> dict[str, PluginSpec]:
    """op_type -> spec of every registered family with a plugin (registry.CPU_ONLY families have none; imports
    the family files, hence torch and triton)."""
    from .registry import families

    return {f.plugin.SPEC.name: f.plugin.SPEC for f in families() if f.gpu}


def register_creators(trt, *, sm: int, path: str | dict[str, str] = "aot") -> dict[str, str]:
    """Register an IPluginV3 creator per plugin in namespace "k3" (replacing ones this process registered
    with other settings); `path` is one request for all or op_type -> path. Returns op_type -> path taken."""
    from ..plugins.adapter import creator

    registry, taken = trt.get_plugin_registry(), {}
    for name, spec in specs().items():
        taken[name] = spec.resolve_path(path if isinstance(path, str) else path[name])
        key = (id(trt), name)
        old = _REGISTERED.get(key)
        if old is not None and (old.sm, old.path) == (sm, taken[name]):
            continue
        if old is not None:
            registry.deregister_creator(old)
        c = creator(trt, spec, sm=sm, path=taken[name])
        if not registry.register_creator(c, spec.namespace):
            raise PluginError(f"k3::{name}: plugin creator could not be registered (another library owns k3::{name}?)")
        _REGISTERED[key] = c  # TensorRT holds a raw pointer: keep the Python object alive
    _register_collectives(trt, registry)
    return taken


def _register_collectives(trt, registry) -> None:
    """The rank programs' AllReduce / AllGather creators (plugins/collectives.py), once per process."""
    from ..plugins import collectives

    for op in collectives.FIELDS:
        key = (id(trt), op)
        if key in _REGISTERED:
            continue
        c = collectives.creator(trt, op)
        if not registry.register_creator(c, collectives.NAMESPACE):
            raise PluginError(f"k3::{op}: plugin creator could not be registered (another library owns k3::{op}?)")
        _REGISTERED[key] = c


_REGISTERED: dict = {}


def register_qdp(*, sm: int, opt_dims: dict[str, dict]) -> None:
    """TensorRT 11 only: register the QDP (`tensorrt.plugin`) form of every plugin instead of the IPluginV3
    creators (the two cannot share a process: same name/namespace). `opt_dims[op]` are the dims the AOT
    constexprs are chosen at ({op_type: {dim: size}}, the spec's `dims` names). Not exercised in
    CI (no TensorRT 11 there); build_engine uses the IPluginV3 creators."""
    try:
        import tensorrt.plugin as trtp
    except ImportError as e:
        raise PluginError(f"QDP plugins need TensorRT 11 (`pip install tensorrt-cu13`): {e}") from None
    from ..plugins import qdp

    for name, spec in specs().items():
        qdp.register(trtp, spec, sm=sm, opt_dims=opt_dims.get(name, {}))
