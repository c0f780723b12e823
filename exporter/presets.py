"""The presets as a user meets them, and what `--dtype auto` resolves to. Torch-free at import: the CLI's
`--preset` help (cli_flags.py) is made from `PRESET_HELP` before any command imports torch.

Notable choices:
- `PRESET_USES` mirrors model/config.PRESETS (same names, same order; tests/exporter/test_presets.py checks it)
  and adds what the registry does not say: each preset's default dtype and what it is for. One text,
  `PRESET_HELP`, is every command's `--preset` help; `presets_markdown` is the README's `## Presets` table
  (the test compares the README's table with it, so the two cannot drift).
- `--dtype auto` (the default of `export` and `inspect`): a checkpoint's stored dtype (config.json's
  `torch_dtype` / `dtype`, else the safetensors': checkpoint/stored_dtype.py), a preset's default dtype (bf16
  for the published models, fp32 for the small CPU presets; fp32 for one registered at run time). float16
  checkpoints export as fp32 (k3x exports fp32 or bf16; fp32 holds every fp16 value). The choice and its
  reason are one line of the export's output.
- ONNX Runtime's CPU provider has no bf16 kernels (MatMul and the rest): a bf16 model.onnx runs on its CUDA
  provider only, so a bf16 ONNX export says so in the same line and names `--dtype fp32`; the ORT runner's
  refusal on a CPU names that flag too (runtime/ort_runner.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class PresetUse:
    dtype: str  # what --dtype auto gives a preset
    use: str  # what the preset is for


PRESET_USES: dict[str, PresetUse] = {  # model/config.PRESETS order
    "k3": PresetUse("bf16", "Kimi K3 as published: trace with --no-weights, inspect, plan --tp/--ep"),
    "kimi-linear-48b": PresetUse("bf16", "Kimi Linear 48B-A3B as published (SiLU, no block residuals)"),
    "k3-mini": PresetUse("fp32", "tiny, every K3 branch: tests and the quick start"),
    "k3-bench": PresetUse("fp32", "K3's architecture at CPU size: benchmarks"),
    "kimi-linear-mid": PresetUse("fp32", "Kimi Linear at CPU size: prefill / decode benchmarks"),
}
PRESET_NAMES: tuple[str, ...] = tuple(PRESET_USES)
PRESET_HELP = f"Preset name: {', '.join(PRESET_NAMES)} (the README's presets table; inspect --preset NAME)."

# torch dtype name (checkpoint/stored_dtype.py) -> the export dtype --dtype auto picks
EXPORT_DTYPE = {"bfloat16": "bf16", "float32": "fp32", "float16": "fp32", "float64": "fp32"}
ORT_CPU_NOTE = ("model.onnx needs ONNX Runtime's CUDA provider (its CPU provider has no bf16 kernels); "
                "export with --trunk bf16 (bf16 projection weights, fp32 activations) or --dtype fp32 to run it "
                "on a CPU")


def model_dtype(asked: str, preset: str | None, checkpoint: Path | None) -> tuple[str, str]:
    """(fp32 | bf16, why) for `--dtype asked` (auto | fp32 | bf16) of a preset or a checkpoint."""
    if asked != "auto":
        return asked, "--dtype"
    if checkpoint is not None:
        from ..checkpoint.stored_dtype import stored_dtype

        name, where = stored_dtype(checkpoint)
        return EXPORT_DTYPE[name], f"auto: {where}"
    if preset not in PRESET_USES:  # a preset registered at run time (model/config.PRESETS), or none: refused there
        from ..model.config import preset as lookup

        lookup(str(preset))  # ConfigError listing the valid presets when it is none
        return "fp32", f"auto: preset {preset} names no default dtype"
    return PRESET_USES[preset].dtype, f"auto: preset {preset}'s default"


def dtype_line(dtype: str, why: str, onnx: bool) -> str:
    """The export's one line saying which dtype it chose and why (with the ONNX Runtime CPU note for bf16 ONNX)."""
    return f"dtype: {dtype} ({why})" + (f"; {ORT_CPU_NOTE}" if onnx and dtype == "bf16" else "")


def _count(n: int) -> str:
    for scale, unit in ((1e12, "T"), (1e9, "B"), (1e6, "M"), (1e3, "K")):
        if n >= scale:
            return f"{n / scale:.3g}{unit}"
    return str(n)


def preset_rows() -> list[tuple[str, str, str, str, str]]:
    """(preset, layers, params, dtype, what it is for) of every preset in the registry (imports torch: the
    parameter count is the meta-device model's)."""
    from ..model.config import PRESETS
    from ..model.summary import param_counts

    rows = []
    for name, cfg in PRESETS.items():
        _, total, active = param_counts(cfg)
        layers = f"{cfg.num_layers} ({len(cfg.kda_layers)} linear-attention, {len(cfg.mla_layers)} MLA)"
        params = f"{_count(total)} ({_count(active)} active)"
        rows.append((name, layers, params, PRESET_USES[name].dtype, PRESET_USES[name].use))
    return rows


def presets_markdown() -> str:
    """The README's presets table (header `| preset |`), one line per preset of the registry."""
    lines = ["| preset | layers | params | dtype (auto) | for |", "|---|---|---|---|---|"]
    lines += [f"| `{n}` | {layers} | {params} | {dtype} | {use} |" for n, layers, params, dtype, use in preset_rows()]
    return "\n".join(lines)
