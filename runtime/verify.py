"""Parity harness: every backend against the eager reference, prefill plus decode steps carrying state.

One random prompt; step 0 is the prefill (past_seq = 0), steps 1..N are T=1 decode steps. Each backend
carries ITS OWN state from step to step (so state-handling bugs accumulate and show), while the next
token is the reference's greedy token for everyone (so all backends see the same inputs even if an
argmax would flip). Every output — logits and every `present.*` — is compared with the tolerance of
the model dtype from runtime/tolerances.py (|a - e| <= atol + rtol |e|), and reported as max-abs and
relative error (max-abs / max |e|). Any failure, non-finite value or missing/mis-shaped output fails
the run; the CLI maps that to exit code 1.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch
from torch import Tensor

from ..model.config import K3Config
from ..model.options import CacheOptions
from .runners import Feeds, Runner, next_feeds, start_feeds
from .tolerances import Tolerance, tol


@dataclass(frozen=True)
class OutputError:
    name: str
    max_abs: float
    rel: float
    ok: bool
    problem: str = ""  # shape / dtype / non-finite / missing


@dataclass
class StepReport:
    backend: str
    step: int  # 0 = prefill
    seconds: float
    errors: list[OutputError]

    @property
    def ok(self) -> bool:
        return all(e.ok for e in self.errors)

    @property
    def worst(self) -> OutputError:
        bad = [e for e in self.errors if not e.ok]
        return bad[0] if bad else max(self.errors, key=lambda e: e.max_abs)


@dataclass
class VerifyReport:
    dtype: Tolerance  # the tolerance key (runtime/tolerances.py): the export's dtype or its trunk's
    steps: list[StepReport] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return bool(self.steps) and all(s.ok for s in self.steps)

    def table(self) -> str:
        atol, rtol = tol(self.dtype).values()
        b = max([len("backend"), *(len(s.backend) for s in self.steps)])  # columns sized to their content
        o = max([len("worst output"), *(len(s.worst.name) for s in self.steps)])
        lines = [f"parity vs eager reference ({str(self.dtype).removeprefix('torch.')}: atol {atol:g}, rtol {rtol:g})",
                 f"{'backend':<{b}} {'step':<9} {'max_abs':>10} {'rel':>10}  {'worst output':<{o}} status"]
        for s in self.steps:
            w = s.worst
            step = "prefill" if s.step == 0 else f"decode {s.step}"
            status = "ok" if s.ok else "FAIL" + (f" ({w.problem})" if w.problem else "")
            lines.append(f"{s.backend:<{b}} {step:<9} {w.max_abs:>10.3g} {w.rel:>10.3g}  {w.name:<{o}} {status}")
        lines.append("PASS" if self.ok else "FAIL")
        return "\n".join(lines)

    def to_json(self) -> dict:
        return {"dtype": str(self.dtype), "ok": self.ok, "steps": [
            {"backend": s.backend, "step": s.step, "seconds": s.seconds, "ok": s.ok,
             "outputs": {e.name: {"max_abs": e.max_abs, "rel": e.rel, "ok": e.ok, "problem": e.problem}
                         for e in s.errors}} for s in self.steps]}


def compare(actual: Tensor | None, expected: Tensor, name: str, dtype: Tolerance) -> OutputError:
    """`actual` against `expected` at the tolerance of `dtype` (a dtype or a key of runtime/tolerances.py)."""
    if actual is None:
        return OutputError(name, float("inf"), float("inf"), False, "missing")
    if tuple(actual.shape) != tuple(expected.shape):
        return OutputError(name, float("inf"), float("inf"), False,
                           f"shape {list(actual.shape)} != {list(expected.shape)}")
    if actual.dtype != expected.dtype:  # e.g. a backend that drops the fp32 KDA state to bf16
        return OutputError(name, float("inf"), float("inf"), False,
                           f"dtype {str(actual.dtype).removeprefix('torch.')} != "
                           f"{str(expected.dtype).removeprefix('torch.')}")
    a, e = actual.detach().cpu().double(), expected.detach().cpu().double()
    if not torch.isfinite(a).all():
        return OutputError(name, float("inf"), float("inf"), False, "non-finite")
    diff = (a - e).abs()
    max_abs = diff.max().item() if diff.numel() else 0.0
    rel = max_abs / (e.abs().max().item() + 1e-30) if diff.numel() else 0.0
    t = tol(dtype)
    ok = bool((diff <= t["atol"] + t["rtol"] * e.abs()).all())
    return OutputError(name, max_abs, rel, ok)


def run_parity(reference: Runner, backends: list[Runner], cfg: K3Config, *, steps: int = 8, batch: int = 1,
               prompt_len: int = 7, dtype: torch.dtype = torch.float32, seed: int = 0,
               cache: CacheOptions | None = None, tolerance: Tolerance | None = None) -> VerifyReport:
    """Prefill + `steps` decode steps per backend, each compared output by output with the reference at
    `tolerance`'s (a key of runtime/tolerances.py; default `dtype`'s)."""
    key = dtype if tolerance is None else tolerance
    if steps < 0 or prompt_len < 1 or batch < 1:
        raise ValueError(f"steps={steps}, prompt_len={prompt_len}, batch={batch}: need steps >= 0, others >= 1")
    gen = torch.Generator().manual_seed(seed)
    prompt = torch.randint(0, cfg.vocab_size, (batch, prompt_len), generator=gen)
    start = start_feeds(cfg, prompt, dtype, cache)
    # the reference trajectory: its outputs per step and the tokens everyone is fed
    ref_outputs: list[Feeds] = []
    feeds = start
    for _ in range(steps + 1):
        out = reference.infer(feeds)
        ref_outputs.append(out)
        feeds = next_feeds(cfg, out, out["logits"][:, -1].argmax(-1, keepdim=True), cache)
    report = VerifyReport(key)
    for runner in backends:
        feeds = start
        for step, expected in enumerate(ref_outputs):
            t0 = time.perf_counter()
            try:
                out = runner.infer(feeds)
            except Exception as e:  # noqa: BLE001 - a crash is a failed step, reported by name
                report.steps.append(StepReport(runner.name, step, 0.0, [OutputError(
                    "<run>", float("inf"), float("inf"), False, f"{type(e).__name__}: {e}")]))
                break
            seconds = time.perf_counter() - t0
            errors = [compare(out.get(n), e, n, key) for n, e in expected.items()]
            report.steps.append(StepReport(runner.name, step, seconds, errors))
            token = expected["logits"][:, -1].argmax(-1, keepdim=True)
            feeds = next_feeds(cfg, out, token, cache) if all(e.problem == "" for e in errors) else None
            if feeds is None:
                break
    return report

