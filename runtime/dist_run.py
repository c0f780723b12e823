"""Running rank programs on torch.distributed: the process group, the named groups, runners, the launcher.

- Inside a launcher (`torchrun --nproc-per-node N -m k3x run DIR`: RANK / WORLD_SIZE set): `init` starts
  the default process group (NCCL when CUDA is there, else gloo; a bounded timeout, so a missing peer is
  an error, not a hang), creates every TP and EP group in the same order on every rank, and registers this
  rank's own two under the names the traced graph uses (model/parallel.py `TP_GROUP` / `EP_GROUP`).
- Without one, `spawn` starts the ranks through torch.distributed's own launcher (`torch.distributed.run`,
  elastic, `--standalone`) with the same command line: `python -m k3x <argv>` in each process (`k3x serve`:
  SIGTERM / SIGINT passed on to the ranks, so rank 0 drains, rather than the agent stopping them); each rank it
  starts gets SIGTERM if that process dies unhandled (`follow_spawner`), so none outlives it.
- `rank_runner`: this rank's program (its folder is an ordinary export folder: hash-checked `.pt2`, or its
  ort-flavor ONNX whose collective nodes are onnxruntime-extensions Python ops calling torch.distributed,
  runtime/ort_collectives.py), fed and answering in the rank's own state layout. `WholeStateRunner`: takes
  and returns the single-GPU state (split for this rank, gathered from the TP group and merged), so the
  parity harness (runtime/verify.run_parity) compares every state with the eager model unchanged; its
  `share` / `with_share` cut a whole state to the rank's and back (the rank state checks, runtime/rank_state.py).
- Serving (`--serving` rank exports): `rank_serving_runner` is this rank's step over its own pools (its KDA
  heads' rows, a replica of the latent); `agree_tokens` gives every rank rank 0's tokens each step, so the
  identical schedulers of all ranks make identical steps (runtime/session.serve_prompts).
"""

from __future__ import annotations

import datetime
import os
from pathlib import Path

import torch
import torch.distributed as dist

from ..folder.artifacts import ExportFolder
from ..model.parallel import ParallelPlan, merge_states, split_states
from ..model.state import state_specs
from .runners import (ARTIFACT_OF, RANK_RUNNERS, Feeds, ModuleRunner, RunnerError, RunnerOptions, load_pt2_artifact,
                      make_runner, serving_entry)

TIMEOUT_S = int(os.environ.get("K3X_DIST_TIMEOUT_S", "120"))


def launched() -> bool:
    """True inside torchrun / torch.distributed.run (every rank has RANK and WORLD_SIZE)."""
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ


def device() -> torch.device:
    if torch.cuda.is_available():
        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
    return torch.device("cpu")


def init(plan: ParallelPlan) -> tuple[int, object]:
    """(this rank, its TP process group) after starting torch.distributed for `plan`."""
    world = int(os.environ["WORLD_SIZE"])
    if world != plan.world:
        raise RunnerError(f"WORLD_SIZE={world}: this export needs tp*ep = {plan.world} processes "
                          f"(torchrun --nproc-per-node {plan.world})")
    if not dist.is_initialized():
        backend = "nccl" if torch.cuda.is_available() else "gloo"
        if backend == "nccl":
            torch.cuda.set_device(device())
        dist.init_process_group(backend, timeout=datetime.timedelta(seconds=TIMEOUT_S))
    rank = dist.get_rank()
    mine: dict[str, object] = {}
    tp_groups = {tuple(plan.tp_group_ranks(e * plan.tp)) for e in range(plan.ep)}
    ep_groups = {tuple(plan.ep_group_ranks(t)) for t in range(plan.tp)}
    for name, groups, own in (("tp", sorted(tp_groups), plan.tp_group_ranks(rank)),
                              ("ep", sorted(ep_groups), plan.ep_group_ranks(rank))):
        for ranks in groups:  # every rank creates every group, in one order
            pg = dist.new_group(list(ranks)) if len(ranks) > 1 else None
            if list(ranks) == own:
                mine[name] = pg
    for name, graph_name in (("tp", plan.tp_group.name), ("ep", plan.ep_group.name)):
        if mine.get(name) is not None:
            torch._C._distributed_c10d._register_process_group(graph_name, mine[name])
    return rank, mine.get("tp")


def rank_backends(export_dir: Path, data: dict) -> list[str]:
    """The runners a sharded export's rank folders hold artifacts for (rank 0's manifest; all ranks alike)."""
    from ..exporter.ranks import rank_folder

    have = ExportFolder.open(rank_folder(export_dir, data, 0)).manifest["artifacts"]
    return [r for r in RANK_RUNNERS if ARTIFACT_OF[r] in have]


def rank_runner(folder: ExportFolder, rank: int, options: RunnerOptions, backend: str = "pt2"):
    """This rank's program (hash-checked, no pickles) on this rank's device: on CUDA the whole pt2 program,
    devices baked into its graph included, is moved to cuda:LOCAL_RANK (`move_to_device_pass`); `ort`
    runs the rank's ort-flavor ONNX (its collectives call torch.distributed from ONNX Runtime)."""
    _check_backend(backend)
    if backend == "ort":
        return make_runner("ort", folder, options)
    module, dev = _rank_module(folder, options, "the rank program")
    return ModuleRunner(f"pt2 rank {rank}", module if dev.type == "cpu" else _OnDevice(module, dev), folder.config())


def rank_serving_runner(folder: ExportFolder, rank: int, options: RunnerOptions, backend: str = "pt2"):
    """This rank's serving step (`k3x export --serving --tp/--ep`): the packed step inputs and the rank's own
    pools (its folder's `serving` entry), on this rank's device (the pools then live there too)."""
    from .serve import StepModuleRunner, serving_runner

    _check_backend(backend)
    if backend == "ort":
        return serving_runner("ort", folder, options)
    entry = serving_entry(folder)
    module, dev = _rank_module(folder, options, "the rank's serving step")
    return StepModuleRunner(f"pt2 rank {rank}", module, entry["inputs"], entry["outputs"],
                            None if dev.type == "cpu" else str(dev))


def agree_tokens(tokens: list[int]) -> list[int]:
    """Rank 0's tokens on every rank (one broadcast of a step's B ids): every rank runs the same scheduler,
    whose state depends only on the prompts, the options and these tokens, so the ranks' steps stay identical."""
    t = torch.tensor(tokens, dtype=torch.int64, device=device())
    dist.broadcast(t, src=0)
    return t.tolist()


def _check_backend(backend: str) -> None:
    if backend not in RANK_RUNNERS:
        raise RunnerError(f"backend={backend!r}: rank programs run on {sorted(RANK_RUNNERS)}")


def _rank_module(folder: ExportFolder, options: RunnerOptions, what: str):
    """(the rank folder's pt2 program as a module, this rank's device); on CUDA moved there."""
    from torch.export.passes import move_to_device_pass

    ep = load_pt2_artifact(folder, options, what)
    dev = device()
    return (ep if dev.type == "cpu" else move_to_device_pass(ep, str(dev))).module(), dev


class _OnDevice:
    def __init__(self, module, dev: torch.device) -> None:
        self.module, self.dev = module, dev

    def __call__(self, ids, past):
        logits, present = self.module(ids.to(self.dev), [t.to(self.dev) for t in past])
        return logits.cpu(), [t.cpu() for t in present]


class WholeStateRunner:
    """This rank's program behind the single-GPU interface: whole state in, whole state out."""

    def __init__(self, runner, full_cfg, local_cfg, plan: ParallelPlan, rank: int, tp_pg, backend: str = "pt2") -> None:
        self.name = f"{backend} ranks(tp={plan.tp},ep={plan.ep})"
        self.runner, self.cfg, self.plan, self.tp_pg = runner, full_cfg, plan, tp_pg
        self.tp_rank, self.specs, self.local_specs = plan.tp_rank(rank), state_specs(full_cfg), state_specs(local_cfg)

    def share(self, whole: Feeds, side: str = "input_name") -> Feeds:
        """This rank's share of the whole-state inputs (`side="output_name"`: outputs) `whole`: its KDA heads,
        the latent whole; the other entries (input ids, logits) as they are."""
        local = split_states(self.cfg, self.plan, [whole[getattr(s, side)] for s in self.specs], self.tp_rank)
        return {**whole, **{getattr(s, side): t for s, t in zip(self.local_specs, local)}}

    def with_share(self, whole: Feeds, share: Feeds) -> Feeds:
        """The whole-state inputs `whole` with this rank's share taken from `share` (the other ranks' kept)."""
        full = [whole[s.input_name] for s in self.specs]
        per_rank = [split_states(self.cfg, self.plan, full, r) for r in range(self.plan.tp)]
        per_rank[self.tp_rank] = [share[s.input_name] for s in self.local_specs]
        merged = merge_states(self.cfg, self.plan, per_rank)
        return {**whole, **{s.input_name: t for s, t in zip(self.specs, merged)}}

    def infer(self, feeds: Feeds) -> Feeds:
        out = self.runner.infer(self.share({"input_ids": feeds["input_ids"],
                                            **{s.input_name: feeds[s.input_name] for s in self.specs}}))
        mine = [out[s.output_name] for s in self.local_specs]
        per_rank = [mine]
        if self.plan.tp > 1:
            per_rank = [[torch.empty_like(t) for t in mine] for _ in range(self.plan.tp)]
            for i, t in enumerate(mine):
                dist.all_gather([p[i] for p in per_rank], t.contiguous(), group=self.tp_pg)
        merged = merge_states(self.cfg, self.plan, per_rank)
        return {"logits": out["logits"], **{s.output_name: t for s, t in zip(self.specs, merged)}}


def omp_threads(world: int) -> int:
    """OpenMP threads per rank when k3x starts `world` ranks on this machine: the cores shared out."""
    return max(1, (os.cpu_count() or 1) // world)


SPAWNED_BY = "K3X_SPAWNED_BY"  # in a rank `spawn` started: the pid of the `k3x` process that started it


def spawn(world: int, argv: list[str], *, pass_signals: bool = False) -> None:
    """Run `python -m k3x <argv>` in `world` processes through torch.distributed.run (standalone rendezvous).
    Raises RunnerError naming the failed rank. `pass_signals` (k3x serve): each SIGTERM / SIGINT is passed on to
    the ranks as it comes and the agent waits for them (rank 0 drains at the first, exits at the second; the
    others wait for its word), so the command's status is theirs."""
    import signal

    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import get_args_parser, run

    own = ["--signals-to-handle=SIGHUP,SIGQUIT"] if pass_signals else []  # the agent leaves SIGTERM / SIGINT
    args = get_args_parser().parse_args(["--standalone", f"--nproc-per-node={world}", "--max-restarts=0", *own,
                                         "--module", "k3x", *argv])
    # the ranks share this machine's cores; set here, torch.distributed.run does not print its OMP_NUM_THREADS
    # banner (written for torchrun users) to someone who never ran torchrun
    os.environ.setdefault("OMP_NUM_THREADS", str(omp_threads(world)))
    if pass_signals:
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, _pass_on)
    os.environ[SPAWNED_BY] = str(os.getpid())  # the ranks' environment (`follow_spawner`), for as long as they run
    try:
        run(args)
    except ChildFailedError as e:
        first = next(iter(e.failures.values()), None)
        raise RunnerError(f"torch.distributed.run: {len(e.failures)} of {world} ranks failed"
                          + (f" (rank {first.local_rank}: exit {first.exitcode})" if first else "")) from None
    finally:
        os.environ.pop(SPAWNED_BY, None)


def follow_spawner() -> None:
    """In a rank `spawn` started (`python -m k3x` calls this first): SIGTERM to this rank when the `k3x` process
    that started it dies, however it dies (Linux's PR_SET_PDEATHSIG), as that process passes its own SIGTERM on.
    A SIGKILL to `k3x serve` used to leave its ranks serving on the port, the process the user ran gone. Exits
    at once if it is gone already (it died before this ran)."""
    import ctypes
    import signal
    import sys

    spawner = os.environ.get(SPAWNED_BY)
    if spawner is None or not sys.platform.startswith("linux"):
        return
    PR_SET_PDEATHSIG = 1
    if ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0) != 0:
        return  # not granted: the ranks end as they did, when their peers or their launcher's agent go
    if os.getppid() != int(spawner):
        sys.exit(f"error: rank {os.environ.get('RANK', '?')}: the k3x process that started it (pid {spawner}) "
                 "is gone")


def _pass_on(sig: int, frame) -> None:
    """A signal to this process, sent to the rank processes it started (those with a LOCAL_RANK)."""
    import psutil

    for child in psutil.Process().children():
        try:
            if "LOCAL_RANK" in child.environ():
                child.send_signal(sig)
        except psutil.Error:
            pass  # gone already


def peak_rss_mib() -> float:
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0


def shutdown() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()
