"""Shared pieces of the serving benches (bench/serving*.py; CPU, ONNX Runtime).

- `serving_folder`: the serving export timed: `--export DIR` (an existing `k3x export --serving` folder with
  the ort flavor) or the `--preset` exported into a temp folder (random fp32 weights);
- `StepCase`: pools for one case (slots, latent blocks) with random state (timing does not depend on the
  values; the tokens, which pick the experts, come from a seeded generator) and the feeds of a step of
  `batch` sequences, `tokens` each, at `past` positions;
- `timed_rounds`: cases interleaved (each first in turn), repeated in rounds -> median and the spread (lowest
  and highest round median) of each case, and of ratios taken round by round;
- `profile_runs`: an ONNX Runtime profile (RunnerOptions.profile) -> per run, microseconds by layer kind
  (kda / mla / other) and the mixers' own share, function bodies attributed to the node that called them;
- `profiled_rounds`: timed rounds on one profiled session, each timed step's share of the profile beside it.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import re
import statistics
import tempfile
import time
from collections import defaultdict
from pathlib import Path
from typing import Callable, Iterator


def common_args(p: argparse.ArgumentParser, preset: str = "k3-bench") -> None:
    p.add_argument("--preset", default=preset, help="exported into a temp folder unless --export is given")
    p.add_argument("--export", type=Path, help="an existing serving export (ort flavor) to time instead")
    p.add_argument("--block-size", type=int, default=16, help="latent block size of the temp export")
    p.add_argument("--threads", type=int, default=2, help="ONNX Runtime intra-op threads (and torch's)")
    p.add_argument("--rounds", type=int, default=5, help="rounds of interleaved repeats (spread: across rounds)")
    p.add_argument("--json", type=Path, help="write the figures here")


@contextlib.contextmanager
def serving_folder(args: argparse.Namespace) -> Iterator[Path]:
    if args.export is not None:
        yield args.export
        return
    from k3x.exporter.options import ExportOptions, Target
    from k3x.exporter.pipeline import export

    with tempfile.TemporaryDirectory(prefix="k3x-bench-") as tmp:
        out = Path(tmp) / "x"
        # flat layers: `profile_runs` attributes inlined k3 bodies to their callers in the main graph
        export(ExportOptions((Target.ONNX,), out, preset=args.preset, serving=True, block_size=args.block_size,
                             onnx_functions=False))
        yield out


def open_serving(path: Path, threads: int, profile: str | None = None, backend: str = "ort"):
    """(runner, config, block size) of a serving export, through its `backend` serving runner (ORT by
    default; "pt2": the step program in this process, torch on `threads` threads)."""
    import torch

    from k3x.runtime.runners import RunnerOptions, open_folder
    from k3x.runtime.serve import serving_runner

    torch.set_num_threads(threads)
    folder = open_folder(path)
    runner = serving_runner(backend, folder, RunnerOptions(provider="cpu", intra_op_threads=threads, profile=profile))
    return runner, folder.config(), int(folder.manifest["serving"]["block_size"])


class StepCase:
    """`batch` sequences with room for `positions` each, in pools for `capacity` positions (at least what
    the batch holds); sequence b owns slot b (`scattered`: slot batch-1-b, so no step's slots are consecutive
    and its KDA rows go through scratch and the write-back, runtime/step_outputs.py) and blocks b*per ..
    (b+1)*per-1. The state is random: a step's time does not depend on its values. The pools are on `device`
    (the latents in `dtype`); the feeds stay on the CPU (runners move them), as serve() makes them."""

    def __init__(self, cfg, *, batch: int, positions: int, capacity: int, block_size: int, seed: int = 0,
                 scattered: bool = False, dtype=None, device: str = "cpu") -> None:
        import torch

        from k3x.model.state import blocks_for
        from k3x.runtime.pools import StatePools

        self.cfg, self.batch, self.block_size = cfg, batch, block_size
        self.slots = (torch.arange(batch - 1, -1, -1) if scattered else torch.arange(batch)).to(torch.int32)
        per = blocks_for(positions, block_size)
        blocks = max(blocks_for(capacity, block_size), batch * per)
        self.pools = StatePools(cfg, slots=batch, blocks=blocks, block_size=block_size,
                                dtype=dtype or torch.float32, device=device)
        self.table = torch.arange(batch * per, dtype=torch.int32).view(batch, per)
        self.ids = torch.Generator().manual_seed(seed + 1)  # the tokens fed: MoE routing (and its path) repeatable
        g = torch.Generator(device=device).manual_seed(seed)
        for name, t in self.pools.tensors.items():  # only what the batch owns: a 1M-position pool stays untouched
            part = t[: batch * per] if name.endswith(".latent") else t
            part.normal_(0.0, 0.1, generator=g)  # in place: no pool-sized temporary (serving_long --tail's peak)

    def feeds(self, tokens: int, past: int) -> dict:
        import torch

        from k3x.model.state import blocks_for

        b, i32 = self.batch, torch.int32
        return {"input_ids": torch.randint(0, self.cfg.vocab_size, (b * tokens,), generator=self.ids),
                "cu_seqlens": torch.arange(b + 1, dtype=i32) * tokens,
                "past_lens": torch.full((b,), past, dtype=i32), "slots": self.slots,
                "block_table": self.table[:, : blocks_for(past + tokens, self.block_size)].contiguous(),
                "logits_index": torch.arange(1, b + 1) * tokens - 1, **self.pools.tensors}

    def timer(self, runner, tokens: int, past: int) -> Callable[[], float]:
        """A function timing (seconds) one step of `tokens` per sequence at `past` positions as `serve` runs
        it: the outputs written where runtime/step_outputs.py puts them (the KDA rows in place: the slots
        are consecutive), then the write-back of what is left (the latents). Pools on a GPU: the device is
        synchronised before and after, so the time is the step's, not its launches'."""
        import torch

        from k3x.runtime.base import torch_threads_for
        from k3x.runtime.step_outputs import StepOutputs, infer_step

        outputs = StepOutputs(self.pools)
        on_gpu = next(iter(self.pools.tensors.values())).is_cuda
        sync = torch.cuda.synchronize if on_gpu else (lambda: None)

        def one() -> float:
            with torch_threads_for(runner):  # as serve() drives it
                feeds = self.feeds(tokens, past)
                sync()
                t = time.perf_counter()
                self.pools.write_back(feeds, infer_step(runner, feeds, outputs))
                sync()
                return time.perf_counter() - t
        return one


SETTLE_S = 0.1  # idle time before each timed call (timed_rounds)


def timed_rounds(steps: dict[str, Callable[[], float]], rounds: int, repeats: int) -> dict[str, list[float]]:
    """Per case, its median ms in each round; within a round the cases are interleaved, each first in turn
    (machine noise hits them alike). One untimed call of each first (lazy inits). Each call starts after
    SETTLE_S of idle time: the threads of the case before (torch's OpenMP workers, ONNX Runtime's pool)
    spin for a while after their work, and a call started among them loses cores to them: the order of the
    cases, not their cost (serving_prefill, k3-bench, two runs each way: with the pause the torch GEMM pass
    ran 7-11 % faster, the ORT prefill 0-5 %)."""
    for f in steps.values():
        f()
    names, out = list(steps), {k: [] for k in steps}
    for _ in range(rounds):
        times: dict[str, list[float]] = {k: [] for k in names}
        for i in range(repeats):
            for k in names[i % len(names):] + names[: i % len(names)]:
                time.sleep(SETTLE_S)
                times[k].append(steps[k]())
        for k in names:
            out[k].append(statistics.median(times[k]) * 1e3)
    return out


def summary(values: list[float]) -> dict[str, float]:
    """Median and spread (lowest, highest) of per-round figures."""
    return {"median": statistics.median(values), "low": min(values), "high": max(values)}


def fmt(s: dict[str, float], digits: int = 2) -> str:
    return f"{s['median']:.{digits}f} [{s['low']:.{digits}f}-{s['high']:.{digits}f}]"


INLINED = re.compile(r"_inlfunc_([A-Za-z0-9]+?)_(?:token_\d+_)?\1/")  # ORT's names of an inlined call's nodes
LAYER = re.compile(r"layers\.(\d+)/")
MIXER_FUNCTIONS = ("KDAPacked", "MLAPaged")
CONTROL_FLOW = ("Loop", "If", "Scan")  # their subgraphs' nodes are profiled too: counted there, not twice


def kernel_nodes(events: list[dict]) -> list[dict]:
    """The profile's node kernel events, control-flow nodes left out (their bodies' nodes carry the time)."""
    return [e for e in events if e.get("cat") == "Node" and e["name"].endswith("_kernel_time")
            and e["args"].get("op_name") not in CONTROL_FLOW]


def run_of(e: dict, starts: list[int]) -> int:
    return max(j for j, s in enumerate(starts) if s <= e["ts"])


def function_callers(onnx_path: Path) -> dict[str, list[str]]:
    """Per local function, the names of the nodes that call it, in graph order."""
    import onnx

    from k3x.exporter.onnx_functions import DOMAIN

    m = onnx.load(str(onnx_path), load_external_data=False)
    if any(f.domain == DOMAIN for f in m.functions):
        raise ValueError(f"{onnx_path}: its layers are ONNX functions; profiles are attributed on a flat export "
                         "(k3x export --no-onnx-functions)")
    local = {f.name for f in m.functions}
    out: dict[str, list[str]] = defaultdict(list)
    for n in m.graph.node:
        if n.op_type in local:
            out[n.op_type].append(n.name)
    return dict(out)


def inlined_callers(nodes: list[dict], callers: dict[str, list[str]]) -> dict[str, tuple[str, bool]]:
    """ORT names the nodes it inlines from one call `_inlfunc_<fn>_token_<k>_<fn>/...` (the first call of each
    function without a token), k counting in an order of its own. The calls of one function lie on the
    layers' sequential chain, so they execute in the graph's order: sorted by the median position of their
    nodes in one run, the j-th call is the function's j-th caller -> {call prefix: (caller node name, whether
    it is a mixer's call)}. A call from inside another function's body (MoEDispatch in k3::MoE's, when the
    kernel library is not built) is named without its caller's prefix: it belongs to whatever ran just before
    its first node."""
    ordered = sorted(nodes, key=lambda e: e["ts"])
    where: dict[str, list[int]] = defaultdict(list)
    for i, e in enumerate(ordered):
        m = INLINED.search(e["name"])
        if m:
            where[m.group(0)].append(i)
    by_fn: dict[str, list[str]] = defaultdict(list)
    for call in sorted(where, key=lambda c: statistics.median(where[c])):
        by_fn[INLINED.search(call).group(1)].append(call)
    out: dict[str, tuple[str, bool]] = {}
    for fn, calls in by_fn.items():
        if fn not in callers:
            continue  # nested: below
        if len(calls) != len(callers[fn]):
            raise ValueError(f"profile: {len(calls)} inlined calls of {fn}, the graph has {len(callers[fn])}")
        out.update((call, (caller, fn in MIXER_FUNCTIONS)) for call, caller in zip(calls, callers[fn]))
    for call in sorted((c for c in where if c not in out), key=lambda c: min(where[c])):  # nested, in run order
        first = min(where[call])
        out[call] = owner(ordered[first - 1]["name"], out) if first > 0 else ("", False)
    return out


def owner(name: str, inlined: dict[str, tuple[str, bool]]) -> tuple[str, bool]:
    """(the main-graph node a profiled node belongs to, whether it is a mixer's work)."""
    m = INLINED.search(name)
    return inlined[m.group(0)] if m else (name, "/self_attn/" in name)


def node_part(name: str, inlined: dict[str, tuple[str, bool]], layer_types: tuple[str, ...]) -> tuple[str, bool]:
    """(layer kind: kda | mla | other, whether it is the mixer's own work) of a profiled node."""
    name, mixer = owner(name, inlined)
    layer = LAYER.search(name)
    return (layer_types[int(layer.group(1))] if layer else "other"), mixer


def profile_runs(profile: Path, callers: dict[str, list[str]], layer_types: tuple[str, ...]) -> list[dict]:
    """Per `run` of the session (in order): microseconds of node kernels by layer kind, and of the mixers."""
    events = json.loads(Path(profile).read_text())
    nodes = kernel_nodes(events)
    starts = [e["ts"] for e in events if e.get("name") == "model_run"]
    inlined = inlined_callers([e for e in nodes if e["ts"] >= starts[-1]], callers)  # one run's order
    out = [defaultdict(float) for _ in starts]
    for e in nodes:
        i = run_of(e, starts)
        kind, mixer = node_part(e["name"][: -len("_kernel_time")], inlined, layer_types)
        out[i][kind] += e["dur"]
        if mixer:
            out[i][kind + "_mixer"] += e["dur"]
    return [dict(d) for d in out]


def profiled_rounds(path: Path, a: argparse.Namespace, steps: Callable, split: Callable) -> tuple:
    """`timed_rounds` of the step timers `steps(runner, cfg, block_size)` returns ({case: timer}) on one profiled
    session of the export, and ONNX Runtime's profile split by `split(profile, function_callers, cfg)` (one dict
    per run) -> (cfg, {case: ms per round}, {case: the splits of its timed runs}: the untimed first call of each
    case dropped)."""
    with tempfile.TemporaryDirectory(prefix="k3x-prof-") as tmp:
        runner, cfg, bs = open_serving(path, a.threads, profile=str(Path(tmp) / "ort"))
        order: list = []

        def tracked(case, f: Callable[[], float]) -> Callable[[], float]:
            def one() -> float:
                order.append(case)
                return f()
            return one
        ms = timed_rounds({k: tracked(k, f) for k, f in steps(runner, cfg, bs).items()}, a.rounds, a.repeats)
        runs = split(Path(runner.session.end_profiling()), function_callers(runner.path), cfg)
    if len(runs) != len(order):
        raise RuntimeError(f"profile: {len(runs)} runs, {len(order)} steps timed")
    return cfg, ms, {k: [r for r, m in zip(runs, order) if m == k][1:] for k in ms}


def run_bench(argv: list[str] | None, doc: str, add_args: Callable[[argparse.ArgumentParser], None],
              measure: Callable[[Path, argparse.Namespace], dict], table: Callable[[dict], str]) -> dict:
    """A serving bench's main: its arguments (the common ones, then `add_args`), `measure` on the export,
    the table printed, the JSON written."""
    p = argparse.ArgumentParser(description=doc.splitlines()[0])
    common_args(p)
    add_args(p)
    a = p.parse_args(argv)
    with serving_folder(a) as path:
        r = measure(path, a)
    print(table(r))
    write_json(a.json, r)
    return r


def write_json(path: Path | None, record: dict) -> None:
    if path is not None:
        path.write_text(json.dumps(record, indent=1) + "\n")
