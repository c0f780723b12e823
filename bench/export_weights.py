"""Export with weights from an MXFP4 checkpoint: time, peak RSS, bytes and write throughput per artifact.

    python bench/export_weights.py --preset k3-bench                  # pt2 and onnx, bf16
    python bench/export_weights.py --preset k3 --layers 2 --targets onnx --workdir DIR

1. Synthesises an MXFP4 checkpoint of the preset (optionally truncated to its first `--layers` layers):
   random bytes for the packed experts (windows of a 64 MiB random pool), E8M0 scales in [2^-9, 2^-2], small
   random bf16 for everything else, written shard by shard (2 GiB each) from the meta model's names, so it is
   fast and never holds the model.
2. Measures the disk's sequential write speed in the same folder: as many bytes as the checkpoint holds (at
   least 1 GiB), fsync'd, best of 2 (one short write swings with the page cache and the other users).
3. Exports one target at a time in a child process (`k3x export --checkpoint ... --target T --dtype bf16`),
   reading its peak RSS (ru_maxrss of the child), the trace and stage times and the weights writer's own log
   line (bytes copied file to file / converted, seconds), sums the artifact bytes, then deletes the export
   before the next one (the disk need only hold the checkpoint and one artifact).
pt2 and ONNX from a checkpoint are traced on meta and stream the weights tensor by tensor
(exporter/pt2_weights.py, exporter/onnx_weights.py). The table splits each stage into the weights write and
the rest (graph conversion, the artifact's sha256 for the manifest); `vs disk` is bytes / seconds against
the disk figure. Prints a Markdown table; `--json` also writes the rows.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import save_file

ROOT = Path(__file__).resolve().parents[1]
SHARD = 2 << 30


def synth_checkpoint(cfg, path: Path, seed: int = 0) -> int:
    """An MXFP4 checkpoint of `cfg` with random contents; returns its tensor bytes."""
    from k3x.checkpoint.hf_config import config_to_hf
    from k3x.checkpoint.published import quantization_config
    from k3x.model import build_model
    from k3x.model.options import BuildOptions

    g = torch.Generator().manual_seed(seed)
    rng = np.random.default_rng(seed)
    pool = rng.integers(0, 256, 64 << 20, dtype=np.uint8)  # random bytes are slow to make (~40-200 MB/s here):
    scale_pool = (pool & 7) + 118  # each tensor is a window of a 64 MiB random pool at a random start

    def window(src: np.ndarray, shape) -> torch.Tensor:
        n, start = int(np.prod(shape)), int(rng.integers(0, len(src)))
        reps = -(-(start + n) // len(src))
        return torch.from_numpy(np.tile(src, reps)[start: start + n].reshape(shape) if reps > 1
                                else src[start: start + n].reshape(shape).copy())
    meta = build_model(cfg, BuildOptions(expert_format="mxfp4"), device="meta", dtype=torch.bfloat16, seed=None)
    path.mkdir(parents=True)
    state, shard, size, weight_map, files, total = meta.state_dict(), {}, 0, {}, 0, 0

    def flush():
        nonlocal shard, size, files
        if shard:
            files += 1
            name = f"model-{files:05d}.safetensors"
            save_file(shard, str(path / name), metadata={"format": "pt"})
            weight_map.update({k: name for k in shard})
            shard, size = {}, 0

    def put(name: str, t: torch.Tensor):
        nonlocal size, total
        if size + t.nbytes > SHARD:
            flush()
        shard[name], size, total = t, size + t.nbytes, total + t.nbytes

    for name, m in state.items():
        base = re.match(r"^(.*\.experts)\.(w[123])(_scale)?$", name)
        if base and base.group(3):
            continue
        if base:
            for e in range(m.shape[0]):
                stem = f"{base.group(1)}.{e}.{base.group(2)}"
                put(f"{stem}.weight_packed", window(pool, m.shape[1:]))
                sshape = state[f"{name}_scale"].shape[1:]
                put(f"{stem}.weight_scale", window(scale_pool, sshape))
        elif m.dtype == torch.float32:
            put(name, torch.rand(m.shape, generator=g) * 0.02)
        else:
            put(name, (torch.rand(m.shape, generator=g, dtype=torch.float32) * 0.04 - 0.02).to(m.dtype))
    flush()
    names = {f"model-{i:05d}.safetensors": f"model-{i:05d}-of-{files:05d}.safetensors" for i in range(1, files + 1)}
    for old, new in names.items():
        os.replace(path / old, path / new)
    index = {"metadata": {"total_size": total}, "weight_map": {k: names[v] for k, v in weight_map.items()}}
    (path / "model.safetensors.index.json").write_text(json.dumps(index))
    block = quantization_config({k: tuple(m.shape) for k, m in state.items()})  # packed experts need it
    (path / "config.json").write_text(json.dumps(config_to_hf(cfg, dtype=torch.bfloat16, quantization=block),
                                                 indent=2))
    return total


def disk_write_speed(folder: Path, nbytes: int = 1 << 30, tries: int = 2) -> float:
    """Sequential write of `nbytes` (fsync'd), bytes per second: the best of `tries`."""
    block = os.urandom(16 << 20)
    f = folder / ".write-speed"
    best = 0.0
    for _ in range(tries):
        t = time.perf_counter()
        with open(f, "wb") as h:
            for _ in range(max(1, nbytes // len(block))):
                h.write(block)
            h.flush()
            os.fsync(h.fileno())
        best = max(best, max(1, nbytes // len(block)) * len(block) / (time.perf_counter() - t))
        f.unlink()
    return best


CHILD = ("import resource, subprocess, sys; r = subprocess.run(sys.argv[1:], capture_output=True, text=True); "
         "sys.stdout.write(r.stdout + r.stderr); "
         "print('PEAK_RSS_KB', resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss); sys.exit(r.returncode)")


EXPORT = ("import logging, sys; logging.basicConfig(level=logging.WARNING, format='%(message)s'); "
          "logging.getLogger('k3x.weights').setLevel(logging.INFO); from k3x.cli import app; app()")
WRITTEN = re.compile(r"weights written \S+: copied (\d+) B, converted (\d+) B, ([\d.]+) s")


def export_one(ckpt: Path, out: Path, target: str) -> dict:
    cmd = [sys.executable, "-c", CHILD, sys.executable, "-c", EXPORT, "export",
           "--checkpoint", str(ckpt), "--out", str(out), "--target", target, "--dtype", "bf16"]
    t = time.perf_counter()
    r = subprocess.run(cmd, capture_output=True, text=True, env=os.environ | {"PYTHONPATH": str(ROOT / ".pyshim")})
    wall = time.perf_counter() - t
    if r.returncode:
        raise SystemExit(f"export --target {target} failed:\n{r.stdout[-3000:]}")
    stage = float(re.search(rf"\[{target}\] done in ([\d.]+) s", r.stdout).group(1))
    traced = float(re.search(r"\[trace\] done in ([\d.]+) s", r.stdout).group(1))
    copied, converted, weights_s = WRITTEN.search(r.stdout).groups()
    files = {p.name: p.stat().st_size for p in out.iterdir() if p.name.startswith("model.")}
    return {"target": target, "wall_s": round(wall, 1), "trace_s": traced, "stage_s": stage,
            "weights_s": float(weights_s), "copied_bytes": int(copied), "converted_bytes": int(converted),
            "bytes": sum(files.values()),
            "files": files, "peak_rss_bytes": int(re.search(r"PEAK_RSS_KB (\d+)", r.stdout).group(1)) * 1024}


LOAD = ("import gc, sys, psutil, torch; from k3x.checkpoint.files import load_checkpoint, stream_tensors; "
        "next(iter(stream_tensors(sys.argv[1], dtype=torch.bfloat16))); "  # warm-up: imports, libraries, headers
        "p = psutil.Process(); gc.collect(); before = p.memory_info().rss; "
        "m = load_checkpoint(sys.argv[1], dtype=torch.bfloat16); gc.collect(); after = p.memory_info().rss; "
        "held = sum(t.nbytes for t in m.state_dict().values()); print('LOAD', before, after, held)")


def load_rss(ckpt: Path) -> dict:
    """RSS growth of a process loading the checkpoint (bf16, MXFP4 experts packed) and the tensor bytes held;
    measured after a warm-up that imports everything and reads one tensor (fixed costs, about 0.15 GB)."""
    r = subprocess.run([sys.executable, "-c", LOAD, str(ckpt)], capture_output=True, text=True, check=True,
                       env=os.environ | {"PYTHONPATH": str(ROOT / ".pyshim")})
    before, after, held = (int(x) for x in re.search(r"LOAD (\d+) (\d+) (\d+)", r.stdout).groups())
    return {"rss_growth_bytes": after - before, "held_bytes": held}


def main() -> None:
    from k3x.model.config import preset

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="k3-bench")
    ap.add_argument("--layers", type=int, default=None, help="keep the first N layers")
    ap.add_argument("--targets", default="pt2,onnx")
    ap.add_argument("--workdir", type=Path, default=Path("/tmp/k3x-export-weights"))
    ap.add_argument("--json", type=Path, default=None)
    ap.add_argument("--load", action="store_true", help="also measure a loaded model's RSS (needs the RAM)")
    a = ap.parse_args()
    cfg = preset(a.preset)
    if a.layers:
        cfg = dataclasses.replace(cfg, name=f"{cfg.name}-{a.layers}l", layer_types=cfg.layer_types[: a.layers],
                                  mlp_types=cfg.mlp_types[: a.layers])
    if a.workdir.exists():
        raise SystemExit(f"{a.workdir}: exists; give a new folder")
    a.workdir.mkdir(parents=True)
    try:
        t = time.perf_counter()
        ckpt_bytes = synth_checkpoint(cfg, a.workdir / "ckpt")
        synth = time.perf_counter() - t
        speed = disk_write_speed(a.workdir, ckpt_bytes)
        largest = max(p.stat().st_size for p in (a.workdir / "ckpt").glob("*.safetensors"))
        from k3x.model import build_model
        from k3x.model.options import BuildOptions

        meta = build_model(cfg, BuildOptions(expert_format="mxfp4"), device="meta", dtype=torch.bfloat16)
        big = max(t.numel() * t.element_size() for t in meta.state_dict().values())
        print(f"{cfg.name}: checkpoint {ckpt_bytes / 1e9:.3f} GB of tensors (synthesised in {synth:.1f} s, largest "
              f"shard {largest / 1e9:.2f} GB, largest model tensor {big / 1e9:.3f} GB); disk sequential write "
              f"{speed / 1e6:.0f} MB/s")
        if a.load:
            m = load_rss(a.workdir / "ckpt")
            print(f"load_checkpoint (bf16, experts packed): RSS +{m['rss_growth_bytes'] / 1e9:.3f} GB, tensors held "
                  f"{m['held_bytes'] / 1e9:.3f} GB = {m['rss_growth_bytes'] / ckpt_bytes:.3f} x the checkpoint's bytes")
        rows = []
        for target in a.targets.split(","):
            out = a.workdir / f"export-{target}"
            row = export_one(a.workdir / "ckpt", out, target)
            shutil.rmtree(out)
            weights = row["copied_bytes"] + row["converted_bytes"]
            row |= {"bytes_vs_checkpoint": row["bytes"] / ckpt_bytes,
                    "write_MBps": row["bytes"] / row["stage_s"] / 1e6,
                    "write_vs_disk": row["bytes"] / row["stage_s"] / speed,
                    "weights_MBps": weights / row["weights_s"] / 1e6,
                    "weights_vs_disk": weights / row["weights_s"] / speed,
                    "rss_bound_bytes": (1 << 30) + 2 * big}
            rows.append(row)
        print("| target | trace s | stage s | weights write s | rest of stage s | bytes | vs checkpoint | copied | "
              "weights MB/s | vs disk | stage MB/s | vs disk | peak RSS | RSS bound (1 GB + 2x largest) |")
        print("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
        for r in rows:
            copied = r["copied_bytes"] / max(1, r["copied_bytes"] + r["converted_bytes"])
            print(f"| {r['target']} | {r['trace_s']:.1f} | {r['stage_s']:.1f} | {r['weights_s']:.1f} | "
                  f"{r['stage_s'] - r['weights_s']:.1f} | {r['bytes'] / 1e9:.3f} GB | {r['bytes_vs_checkpoint']:.3f} | "
                  f"{copied:.1%} | {r['weights_MBps']:.0f} | {r['weights_vs_disk']:.0%} | {r['write_MBps']:.0f} | "
                  f"{r['write_vs_disk']:.0%} | {r['peak_rss_bytes'] / 1e9:.2f} GB | {r['rss_bound_bytes'] / 1e9:.2f} GB |")
        if a.json:
            a.json.write_text(json.dumps({"config": cfg.name, "checkpoint_bytes": ckpt_bytes, "disk_Bps": speed,
                                          "rows": rows}, indent=1))
    finally:
        shutil.rmtree(a.workdir, ignore_errors=True)


if __name__ == "__main__":
    sys.path.insert(0, str(ROOT / ".pyshim"))
    main()
