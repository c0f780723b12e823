"""One runner factory for an export folder of any rank count: `open_session` reads the manifest's `parallel`
entry and gives whole-state runners either way, so `run`, `logits` and `verify` have no sharded branch.

- One program (no `parallel` entry): each backend's runner as `runners.make_runner` builds it.
- Rank programs: inside a launcher (torchrun, or `spawn_world` re-running the same command in `world`
  processes) every rank opens its own program behind `dist_run.WholeStateRunner` (the single-GPU state in and
  out: split for the rank, gathered over TP and merged), so the decode loop and the parity harness are the
  ones of a single program. Rank 0 speaks (`Session.speaks`).
- `open_serving` / `serve_prompts`: the serving step of a `--serving` export of any rank count and
  continuous batching over it (`k3x run --prompts`); on rank programs every rank schedules alike.
- `verify_session`: parity of every backend against the eager model (runtime/verify.run_parity) and the state
  checks (runtime/state_check.py; rank programs: each rank's share, runtime/rank_state.py); for rank programs
  also the greedy tokens, which catch a wrong rank layout the first steps might hide.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from ..exporter.ranks import rank_folder, read_parallel
from ..folder.artifacts import ExportFolder, ManifestError
from ..model.config import K3Config
from ..model.options import CacheOptions
from ..model.parallel import ParallelPlan
from .runners import Runner, RunnerError, RunnerOptions, generate, make_runner, open_folder, runnable
from .state_check import STATE_STEPS, StateFinding, check_state, reference_steps
from .tolerances import Tolerance, parity_key
from .verify import VerifyReport, run_parity


@dataclass
class Session:
    export_dir: Path
    cfg: K3Config  # the whole model's architecture (rank programs: not the rank's slice)
    cache: CacheOptions
    dtype: torch.dtype
    dims: dict[str, Any]  # the traced dynamic dims (manifest `dynamic_dims`)
    plan: ParallelPlan  # 1 x 1 for one program
    rank: int = 0
    contract: dict[str, Any] = field(default_factory=dict)  # the folder's state contract (model/state_contract.py;
    # rank programs: this rank's, its KDA heads; a serving session's: as its pools)
    runners: dict[str, Runner] = field(default_factory=dict)  # whole-state runners by backend
    pool_cfg: K3Config | None = None  # a serving session on rank programs: this rank's config (its pools)
    notes: list[str] = field(default_factory=list)  # lines for the user (printed by the speaking rank)
    tolerance: Tolerance | None = None  # verify's key in runtime/tolerances.py (None: `dtype`'s)

    @property
    def speaks(self) -> bool:
        return self.rank == 0

    @property
    def who(self) -> str:
        """The prefix of this process's error lines ("rank 2: " with rank programs)."""
        return f"rank {self.rank}: " if self.plan.world > 1 else ""

    def describe(self, backend: str) -> str:
        p = self.plan
        return backend if p.world == 1 else f"{p.world} ranks, tp={p.tp} ep={p.ep}, {backend}"

    def close(self) -> None:
        from .dist_run import shutdown

        if self.plan.world > 1:
            shutdown()


Folder = Path | ExportFolder  # every call takes the folder opened once by the command (a path is opened)


def _parallel(folder: ExportFolder) -> tuple[dict, ParallelPlan] | None:
    """(manifest, plan) of rank programs, None for one program; RunnerError naming a bad `parallel` entry."""
    try:
        return read_parallel(folder.path, folder.manifest)
    except ManifestError as e:
        raise RunnerError(str(e)) from None


def parallel_plan(export_dir: Folder) -> ParallelPlan:
    """The plan of the export's `parallel` entry (1 x 1 without one)."""
    found = _parallel(open_folder(export_dir))
    return ParallelPlan(1, 1) if found is None else found[1]


def world_to_spawn(export_dir: Folder) -> int | None:
    """The processes to start for this export when not inside a launcher (None: run here, as it is)."""
    from .dist_run import launched

    plan = parallel_plan(export_dir)
    return plan.world if plan.world > 1 and not launched() else None


def spawn_world(world: int, argv: list[str], *, pass_signals: bool = False) -> None:
    from .dist_run import spawn

    spawn(world, argv, pass_signals=pass_signals)


def backends_of(export_dir: Folder, requested: list[str], *, default_ort: bool = False) -> tuple[list[str], list[str]]:
    """(runners to use, notes): `requested` (each must be in the export) or every one it can run.
    `default_ort`: `k3x run`'s default `--backend ort` on rank programs without ONNX runs pt2 (and says so)."""
    from .dist_run import rank_backends

    folder = open_folder(export_dir)
    found = _parallel(folder)
    if found is None:
        if requested:
            return requested, []
        names = runnable(folder.manifest)
        if "trt" in names and not torch.cuda.is_available():
            return [n for n in names if n != "trt"], ["note: backend trt skipped (no CUDA GPU here)"]
        return names, []
    have = rank_backends(folder.path, found[0])
    if default_ort and requested == ["ort"] and "ort" not in have and "pt2" in have:
        return ["pt2"], ["backend ort: this sharded export has no ONNX; running the pt2 rank programs"]
    missing = [b for b in requested if b not in have]
    if missing:
        raise RunnerError(f"{folder.path}: sharded export has rank programs for {have}, not {missing}")
    return requested or have, []


def open_session(export_dir: Folder, backends: list[str], options: RunnerOptions = RunnerOptions()) -> Session:
    """Runners for `backends` over the export folder, whatever its rank count (rank programs: inside a
    launcher, see `world_to_spawn`). RunnerError (one line) when a runner cannot be built."""
    folder, s, found = _start(export_dir)
    if found is None:
        s.runners = {b: make_runner(b, folder, options) for b in backends}
        return s
    _open_ranks(s, found[0], backends, options)
    return s


def _start(export_dir: Folder) -> tuple[ExportFolder, Session, tuple[dict, ParallelPlan] | None]:
    """(the folder, a session without runners, its `parallel` entry and plan or None for one program)."""
    folder = open_folder(export_dir)
    found = _parallel(folder)
    options = folder.options()
    s = Session(folder.path, folder.config(), options.cache, folder.dtype(),
                folder.manifest["dynamic_dims"], ParallelPlan(1, 1) if found is None else found[1],
                contract=folder.state_contract(), tolerance=parity_key(folder.dtype(), options.build.trunk))
    return folder, s, found


def _open_ranks(s: Session, data: dict, backends: list[str], options: RunnerOptions) -> None:
    from . import dist_run

    own, tp_pg = _own_folder(s, data)
    local, s.contract = own.config(), own.state_contract()
    for b in backends:
        mine = dist_run.rank_runner(own, s.rank, options, b)
        s.runners[b] = dist_run.WholeStateRunner(mine, s.cfg, local, s.plan, s.rank, tp_pg, b)


def _own_folder(s: Session, data: dict) -> tuple[ExportFolder, object]:
    """(this rank's folder, opened once; its TP process group) after joining the ranks (inside a launcher)."""
    from . import dist_run

    if len(data["parallel"]["ranks"]) != s.plan.world:
        raise RunnerError(f"{s.export_dir}: weightless rank export (exported with --no-weights); it cannot run")
    s.rank, tp_pg = dist_run.init(s.plan)
    return open_folder(rank_folder(s.export_dir, data, s.rank)), tp_pg


def open_serving(export_dir: Folder, backend: str, options: RunnerOptions = RunnerOptions()) -> Session:
    """The serving-step runner of a `k3x export --serving` folder of any rank count (`runners[backend]`): one
    program's (runtime/serve.serving_runner) or, inside a launcher, this rank's step with `pool_cfg` its own
    config (its pools: its KDA heads, the whole replicated latent)."""
    from .serve import serving_runner

    folder, s, found = _start(export_dir)
    if found is None:
        s.runners = {backend: serving_runner(backend, folder, options)}
        return s
    from . import dist_run

    own, _ = _own_folder(s, found[0])
    s.pool_cfg, s.contract = own.config(), own.state_contract()
    s.runners = {backend: dist_run.rank_serving_runner(own, s.rank, options, backend)}
    return s


def serve_prompts(s: Session, backend: str, prompts: list[list[int]], sampling, options, *,
                  max_new_tokens: list[int] | None = None, drafter=None, **state):
    """Continuous batching (runtime/serve.serve) on the session's serving step (`drafter`: speculative
    decoding). Rank programs: every rank runs the same scheduler (and prefix cache, over its own pools) over
    the same prompts and takes rank 0's tokens (and drafts) each step (dist_run.agree_tokens), so the packed
    inputs, cache hits and draft acceptance agree on every rank without being sent; only token ids cross.
    `state`: serve's `resume` / `on_prefill` (a state file, one program)."""
    from .serve import serve

    agree = None
    if s.plan.world > 1:
        from .dist_run import agree_tokens as agree
    return serve(s.runners[backend], s.cfg, prompts, sampling, options, max_new_tokens=max_new_tokens, dtype=s.dtype,
                 pool_cfg=s.pool_cfg, agree=agree, drafter=drafter, **state)


def serving_state(s: Session, save: Path | None, load: Path | None, prompt: list[int]):
    """runtime/state_file.serving_hooks for this program of a serving session: (the prompt, serve's `resume` /
    `on_prefill`); rank programs: this rank's file (`FILE.rank{r}of{W}`) under its contract (its pools), the
    whole model's config hash and vocabulary (the logits are whole on every rank), the export's weights."""
    from .state_file import Shard, serving_hooks, weights_origin

    shard = Shard(s.rank, s.plan.world, f"tp={s.plan.tp} ep={s.plan.ep}")
    origin = weights_origin(open_folder(s.export_dir).manifest)
    return serving_hooks(save, load, s.contract, s.cfg, prompt, shard, origin=origin)


def check(s: Session, *, batch: int, prompt_len: int, new_tokens: int, backends: list[str]) -> None:
    """Refuse a request the session cannot serve (runners.check_request; eager unbounded by traced dims)."""
    from .runners import check_request

    for b in backends:
        check_request(s.cfg, batch=batch, prompt_len=prompt_len, new_tokens=new_tokens, backend=b, cache=s.cache,
                      dims=None if b == "eager" else s.dims)


def decode(s: Session, backend: str, prompt: torch.Tensor, sampling, on_token=None, **state):
    """`state`: runners.generate's `start` / `on_prefill` (a state handed across processes)."""
    return generate(s.runners[backend], s.cfg, prompt, sampling, dtype=s.dtype, on_token=on_token, cache=s.cache,
                    **state)


@dataclass
class Verdict:
    report: VerifyReport
    greedy: dict[str, Any] | None = None  # rank programs: {"identical", "tokens", "got"}
    state: list[StateFinding] | None = None  # the state checks (runtime/state_check.py; ranks: rank_state.py)

    @property
    def ok(self) -> bool:
        return self.report.ok and (self.greedy is None or self.greedy["identical"]) and not self.state

    def state_lines(self) -> list[str]:
        """The state checks' verdict: one line when they pass, one per finding when not."""
        if self.state is None:
            return []
        if not self.state:
            return [f"state contract: ok (true state handed in at the prefill and {STATE_STEPS} decode steps)"]
        return ["state contract: FAIL"] + [f"  {f.line()}" for f in self.state]

    def greedy_line(self, tokens: int) -> str:
        """Rank programs: whether the greedy tokens match the reference's."""
        g = self.greedy or {}
        return f"greedy tokens ({tokens}): " + ("identical" if g.get("identical") else
                                                 f"DIFFER {g.get('got')} != {g.get('tokens')}")

    def to_json(self, s: Session, backends: list[str]) -> dict[str, Any]:
        out = self.report.to_json()
        if self.state is not None:
            out |= {"state_ok": not self.state, "state_findings": [f.to_json() for f in self.state]}
        if self.greedy is not None:
            out |= {"greedy_identical": self.greedy["identical"], "tokens": self.greedy["tokens"],
                    "plan": s.plan.to_dict(), "backends": backends}
        return out


def verify_session(s: Session, reference: Runner, backends: list[str], *, steps: int, batch: int, prompt_len: int,
                   seed: int) -> Verdict:
    """Parity of `backends` against `reference` over a prefill and `steps` decode steps, then the state checks;
    rank programs add their greedy tokens against the reference's."""
    from ..text.sampling import SamplingOptions

    runners = [s.runners[b] for b in backends]
    report = run_parity(reference, runners, s.cfg, steps=steps, batch=batch, prompt_len=prompt_len, dtype=s.dtype,
                        seed=seed, cache=s.cache, tolerance=s.tolerance)
    if s.plan.world == 1:
        return Verdict(report, state=_state_findings(s, reference, backends, prompt_len, seed))
    prompt = torch.randint(0, s.cfg.vocab_size, (1, prompt_len), generator=torch.Generator().manual_seed(seed))
    greedy = SamplingOptions(steps + 1)
    want = generate(reference, s.cfg, prompt, greedy, dtype=s.dtype, cache=s.cache).tokens
    gots = [generate(r, s.cfg, prompt, greedy, dtype=s.dtype, cache=s.cache).tokens for r in runners]
    got = next((g for g in gots if not torch.equal(want, g)), want)
    return Verdict(report, {"identical": torch.equal(got, want), "tokens": want.tolist(), "got": got.tolist()},
                   _state_findings(s, reference, backends, prompt_len, seed))


def _state_findings(s: Session, reference: Runner, backends: list[str], prompt_len: int,
                    seed: int) -> list[StateFinding]:
    """Every runner handed the reference's true state, judged against the folder's state contract (rank
    programs: each rank's program its share, against its folder's; runtime/rank_state.py)."""
    prompt = torch.randint(0, s.cfg.vocab_size, (1, prompt_len), generator=torch.Generator().manual_seed(seed))
    run = reference_steps(reference, s.cfg, prompt, STATE_STEPS, s.dtype, s.cache)
    if s.plan.world > 1:
        from .rank_state import rank_state_findings

        return rank_state_findings(reference, {b: s.runners[b] for b in backends}, s.contract, run, rank=s.rank,
                                   prompt=prompt, dtype=s.dtype)
    return [f for b in backends for f in check_state(reference, s.runners[b], s.cfg, s.contract, prompt=prompt,
                                                     dtype=s.dtype, cache=s.cache, run=run, tolerance=s.tolerance)]


def peak_rss_line(s: Session) -> str | None:
    """Rank programs: the peak RSS of every rank (a collective: every rank calls it); None for one program."""
    if s.plan.world == 1:
        return None
    import torch.distributed as dist

    from .dist_run import peak_rss_mib

    rss: list = [None] * dist.get_world_size()
    dist.all_gather_object(rss, round(peak_rss_mib(), 1))
    return "peak RSS per rank (MiB): " + ", ".join(f"{r}: {m}" for r, m in enumerate(rss))
