"""`k3x inspect --export DIR`: each ONNX file's inputs and outputs (name, dtype, shape) as the manifest records
them (exporter/onnx.graph_io), for a user writing their own ONNX Runtime loop, after one line saying how the
weights are held (dtype, CPU trunk, expert format). Read from the manifest only: no ONNX file is opened."""

from __future__ import annotations

from .schema import ManifestError


def _shape(shape: list | None) -> str:
    return "?" if shape is None else "[" + ", ".join("?" if d is None else str(d) for d in shape) + "]"


def weights_line(manifest: dict) -> str:
    """How the export holds its weights: the dtype, the trunk (model/trunk.py) and the routed experts' format."""
    opts = manifest.get("options") if isinstance(manifest.get("options"), dict) else {}
    trunk = {"bf16": "bf16 (bf16 projection weights, fp32 activations)", "int8": "int8 (8-bit projection weights "
             "per block of 32, fp32 activations)"}.get(opts.get("trunk"), str(opts.get("trunk", "dense")))
    return f"weights: dtype {manifest.get('dtype')}, trunk {trunk}, experts {opts.get('expert_format', 'dense')}"


def onnx_io_report(manifest: dict, where: str) -> str:
    """Lines naming each flavor file's inputs and outputs; ManifestError when the export has no ONNX artifact
    or was written before the manifest recorded them."""
    entry = manifest.get("artifacts", {}).get("onnx")
    if not isinstance(entry, dict):
        ranks = (manifest.get("parallel") or {}).get("ranks") or []
        hint = f"; each rank folder holds its own: --export {where}/{ranks[0]['dir']}" if ranks else \
            " (export with --target onnx)"
        raise ManifestError(f"{where}: no ONNX artifact{hint}")
    io, flavors = entry.get("io"), entry.get("flavors") or {}
    if not isinstance(io, dict) or not io:
        raise ManifestError(f"{where}: its manifest does not record the ONNX inputs and outputs (re-export it)")
    lines = [weights_line(manifest)]
    for flavor, sides in io.items():
        lines.append(f"{flavors.get(flavor, flavor)} ({flavor} flavor)")
        for side in ("inputs", "outputs"):
            values = sides[side]
            width = max((len(v["name"]) for v in values), default=0)
            lines.append(f"  {side} ({len(values)}):")
            lines += [f"    {v['name']:<{width}}  {v['dtype']:<8}  {_shape(v['shape'])}" for v in values]
    return "\n".join(lines)
