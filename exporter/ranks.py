"""Rank programs: `k3x export --tp T --ep E` -> one folder per rank and one top-level manifest.

    OUT/manifest.json          a schema-1 manifest of the whole model (full config, dtype, checkpoint, the
                               rank program's op counts) plus `parallel`: the plan, the world size, and for
                               every rank its folder, TP/EP coordinates and files with sha256
    OUT/rank-000/manifest.json an ordinary export folder of rank 0's program (the rank's local config:
    OUT/rank-000/model.pt2     heads / vocab / FFN width divided by tp), its weights inside
    OUT/rank-000/model.onnx    (--target onnx) the same program in ONNX, collectives as nodes
    OUT/rank-000/model.trt.onnx  (exporter/onnx_collectives.py: ort and trt flavors)
    ...

One trace: the rank program is traced once, with rank 0's weights (model/rank.py: ranks differ only in
weights and the two buffers `vocab_start` / `expert_offset`); each other rank's `.pt2` is that program with
its weights swapped in place (`swap_weights`: no graph copy, no re-trace). Weights come from the checkpoint rank by rank
(checkpoint/rank_slices.py: each rank's slices only), or for a preset are cut from one random init.
ONNX (`--target onnx`): rank 0's program is converted once (exporter/onnx.to_onnx_ir); each other rank's
file is that ONNX graph with its initializers swapped (`swap_initializers`), so the graph is the same in
every rank's file. No GenAI package per rank (GenAI does not launch ranks).
`--no-weights` writes rank 0's program only (every rank's graph is the same). The whole folder is staged
and renamed into place like every export (folder/staging.py).
"""

from __future__ import annotations

import dataclasses
import json
from collections import Counter
from pathlib import Path
from typing import Any

import torch

from ..model.parallel import ParallelPlan
from .options import ExportJob, Timed
from .serving import WEIGHT_PREFIX
from .tokenizer import copy_tokenizer

COLLECTIVE_PREFIX = "_c10d_functional::"


def rank_dir_name(rank: int) -> str:
    return f"rank-{rank:03d}"


def collective_counts(ep) -> dict[str, int]:
    """`_c10d_functional::*` node counts of a traced program (wait_tensor excluded)."""
    c = Counter(n.target.name().split(".")[0] for n in ep.graph.nodes
                if n.op == "call_function" and hasattr(n.target, "name")
                and n.target.name().startswith(COLLECTIVE_PREFIX) and "wait_tensor" not in n.target.name())
    return dict(sorted(c.items()))


def write_ranks(work: Path, job: ExportJob, timed: Timed) -> list[str]:
    """The rank programs of `job.plan` (stages pt2, onnx) into `work`, plus the top-level manifest with its
    `parallel` entry. Called by exporter/pipeline.export when the plan has more than one rank."""
    from ..folder import artifacts
    from ..model.rank import build_rank_model
    from .trace import op_counts, save_pt2

    options, cfg, plan, dtype = job.options, job.cfg, job.plan, job.dtype
    local = plan.local_config(cfg)
    full = None
    if options.weights and options.checkpoint is None:
        from ..model import build_model

        full = build_model(cfg, job.model.build, dtype=dtype, seed=options.seed).state_dict()
    with timed("trace"):  # rank 0's module (meta without weights); the others swap in
        model = _rank_model(job, 0, full) if options.weights else build_rank_model(cfg, plan, job.model.build,
                                                                                   dtype=dtype)
        program = _trace(model, job)
    counts = op_counts(program) | collective_counts(program)
    onnx_model = None
    if "onnx" in options.stages():
        from .onnx import to_onnx_ir

        with timed("onnx"):
            onnx_model = to_onnx_ir(program, local, weights=options.weights, serving=_serving(job, local))
    ranks: list[dict[str, Any]] = []
    for r in range(plan.world if options.weights else 1):
        with timed(f"rank {r}"):
            if r > 0:
                prefix = WEIGHT_PREFIX if options.serving else ""  # a serving step holds the model as `lm`
                swap_weights(program, {prefix + n: t for n, t in _rank_model(job, r, full).state_dict().items()})
                if onnx_model is not None:
                    swap_initializers(onnx_model, program.state_dict)
            ranks.append(_write_rank(work, r, job, local, counts, program, save_pt2, onnx_model))
    artifacts.init_manifest(work, cfg, dtype=dtype, weights=options.weights, op_counts=counts,
                            checkpoint=options.checkpoint, checkpoint_hash=job.checkpoint_hash, options=job.model,
                            serving=_serving(job, cfg, top=True))
    notes = [copy_tokenizer(options.checkpoint, work)] if options.checkpoint else []
    data = artifacts.read_manifest(work)
    for r in ranks:
        e = plan.expert_range(cfg, r["rank"])
        r["experts"] = [e.start, e.stop]  # global ids [start, stop) of the rank's experts
    data["parallel"] = {**plan.to_dict(), "ranks": ranks, "rank_config_hash": local.hash()}
    artifacts._write_json_atomic(work / artifacts.MANIFEST, data)
    return notes + [f"ranks: {len(ranks)} rank folder(s) of {plan.world} ranks (tp={plan.tp}, ep={plan.ep}) "
                    f"in {options.out_dir}"]


def _trace(model: torch.nn.Module, job: ExportJob):
    """The rank program: the batch interface, or the serving step (`--serving`: packed sequences, the rank's
    own pools) over the same rank module."""
    if job.options.serving:
        from .serving import trace_serving

        return trace_serving(model, block_size=job.options.block_size, kernels=job.model.build.kernels.value)
    from .trace import trace

    return trace(model)


def _serving(job: ExportJob, cfg, top: bool = False) -> dict[str, Any] | None:
    """The manifest's `serving` entry for `cfg`, None without --serving. A rank folder's is its program's (its
    local config: its own pool shapes); the top manifest's is the whole model's plus `pool_split`: KDA pools
    hold each rank's heads (split over TP like the heads), the MLA latent pool is replicated on every rank
    (the latent is shared by all heads: every rank computes the same latents and keeps a full copy)."""
    if not job.options.serving:
        return None
    from .serving import serving_manifest

    entry = serving_manifest(cfg, job.options.block_size)
    if top:
        entry["pool_split"] = {"conv": "heads over tp", "recurrent": "heads over tp", "latent": "replicated"}
    return entry


def _rank_model(job: ExportJob, rank: int, full: dict | None) -> torch.nn.Module:
    """Rank `rank`'s module with its weights: cut from `full` (a preset's random init) or read slice by
    slice from the checkpoint."""
    from ..checkpoint.rank_slices import load_rank
    from ..model.rank import build_rank_model, rank_state_dict

    build = job.model.build
    if full is None:
        return load_rank(job.options.checkpoint, job.plan, rank, dtype=job.dtype, kernels=build.kernels,
                         expert_format=build.expert_format, activations=build.activations)[1]
    model = build_rank_model(job.cfg, job.plan, build, dtype=job.dtype).to_empty(device="cpu")
    model.load_state_dict(rank_state_dict(full, job.cfg, job.plan, rank, build), strict=True)
    return model


def swap_weights(program, state_dict: dict[str, torch.Tensor]) -> None:
    """Put another rank's weights into `program` in place (same names, shapes and dtypes: the rank programs
    are one graph); no copy of the graph, no re-trace."""
    for name, want in program.state_dict.items():
        t = state_dict[name]
        if tuple(t.shape) != tuple(want.shape) or t.dtype != want.dtype:
            raise ValueError(f"swap_weights: {name} is {tuple(t.shape)} {t.dtype}, the program has "
                             f"{tuple(want.shape)} {want.dtype}")
        program.state_dict[name] = torch.nn.Parameter(t, False) if isinstance(want, torch.nn.Parameter) else t


def swap_initializers(model, state_dict: dict[str, torch.Tensor]) -> None:
    """Put another rank's weights into a converted ONNX model in place (initializers are named like the
    state dict; the flavor passes retype byte tensors again when the files are written)."""
    import onnx_ir as ir

    for name, t in state_dict.items():
        v = model.graph.initializers.get(name)
        if v is None:
            continue  # not read by the graph
        if tuple(v.shape) != tuple(t.shape):
            raise ValueError(f"swap_initializers: {name} is {tuple(t.shape)}, the ONNX graph has {tuple(v.shape)}")
        v.const_value = ir.tensor(t.detach().contiguous(), name=name)


def _write_rank(work: Path, rank: int, job: ExportJob, local, counts: dict[str, int], program, save_pt2,
                onnx_model=None) -> dict[str, Any]:
    from ..folder import artifacts

    options, plan = job.options, job.plan
    d = work / rank_dir_name(rank)
    artifacts.init_manifest(d, local, dtype=job.dtype, weights=options.weights, op_counts=counts,
                            checkpoint=options.checkpoint, checkpoint_hash=job.checkpoint_hash, options=job.model,
                            serving=_serving(job, local))
    stages = options.stages()
    if "pt2" in stages:
        with artifacts.write_artifact(d, "pt2", {"weights": options.weights, "rank": rank,
                                                 "load": "k3x.exporter.trace.load_pt2"}) as tmp:
            save_pt2(program, tmp / "model.pt2")
    if "onnx" in stages:
        from .onnx import OnnxOptions, onnx_stage

        onnx_stage(d, program, local, OnnxOptions(weights=options.weights, serving=_serving(job, local),
                                                  layer_functions=options.onnx_functions), onnx_model)
    files = [{"path": f"{d.name}/{f['path']}", "bytes": f["bytes"], "sha256": f["sha256"], "artifact": name}
             for name, a in artifacts.read_manifest(d)["artifacts"].items() for f in a["files"]]
    return {"rank": rank, "tp_rank": plan.tp_rank(rank), "ep_rank": plan.ep_rank(rank), "dir": d.name,
            "files": files}


def read_parallel(export_dir: str | Path, manifest: dict[str, Any] | None = None
                  ) -> tuple[dict[str, Any], ParallelPlan] | None:
    """(top-level manifest, plan) of a sharded export, None for a single-program export. `manifest`: the top
    manifest already read (`ExportFolder.manifest`; read here when None). Every rank folder is checked to
    be that rank (`_check_rank`) before anything of it is read."""
    from ..folder.artifacts import ManifestError, read_manifest
    from ..folder.trust import confined

    data = read_manifest(export_dir) if manifest is None else manifest
    par = data.get("parallel")
    if par is None:
        return None
    where = Path(export_dir) / "manifest.json"
    try:
        for key in ("tp", "ep"):  # 2.9 is refused, never truncated to 2
            if isinstance(par[key], bool) or not isinstance(par[key], int):
                raise ValueError(f"{key}={repr(par[key])[:40]}: must be an integer")
        plan = ParallelPlan(par["tp"], par["ep"])
        ranks = par["ranks"]
        if not isinstance(ranks, list) or not all(isinstance(r, dict) for r in ranks):
            raise ValueError("ranks must be a list of objects")
        if [r.get("rank") for r in ranks] != list(range(len(ranks))):
            raise ValueError("ranks must list rank 0, 1, ... in order")
        for r in ranks:
            if not isinstance(r.get("dir"), str):
                raise ValueError(f"rank {r.get('rank')}: dir must be a folder name")
            confined(Path(export_dir), r["dir"])
            _check_rank(Path(export_dir), r, where)
    except (KeyError, TypeError, ValueError) as e:
        raise ManifestError(f"{where}: parallel: {str(e)[:200]}") from None
    return data, plan


def _check_rank(export_dir: Path, r: dict[str, Any], where: Path) -> None:
    """Rank folder `r["dir"]` is rank `r["rank"]`: named for it, a real folder of the export (not a symlink to
    another rank's), its manifest listing exactly the files (path, bytes, sha256) the top manifest records for
    that rank, and its pt2 marked with that rank. The runners then check the bytes against that manifest."""
    from ..folder.artifacts import ManifestError, read_manifest

    rank, name = r["rank"], rank_dir_name(r["rank"])
    if r["dir"] != name:
        raise ValueError(f"rank {rank}: dir {str(r['dir'])[:80]!r} must be {name!r}")
    d = export_dir / name
    if d.is_symlink() or not d.is_dir():
        raise ManifestError(f"{d}: rank {rank}'s folder is {'a symlink' if d.is_symlink() else 'missing'}; refused")
    m = read_manifest(d)
    have = sorted((f"{name}/{f['path']}", f["bytes"], f["sha256"], a)
                  for a, e in m["artifacts"].items() for f in e["files"])
    want = sorted((f["path"], f["bytes"], f["sha256"], f["artifact"]) for f in r["files"])
    if have != want:
        raise ManifestError(f"{d}: its files differ from those {where} records for rank {rank} (another rank's "
                            "folder, or changed since the export); refused")
    if m["artifacts"].get("pt2", {}).get("rank", rank) != rank:
        raise ManifestError(f"{d}: its program is rank {str(m['artifacts']['pt2']['rank'])[:20]}'s, not rank {rank}'s; "
                            "refused")


def rank_folder(export_dir: str | Path, data: dict[str, Any], rank: int) -> Path:
    return Path(export_dir) / data["parallel"]["ranks"][rank]["dir"]


def dump_plan(plan: ParallelPlan, cfg) -> str:
    return json.dumps({n: dataclasses.asdict(s) for n, s in plan.table(cfg).items()}, indent=1)
