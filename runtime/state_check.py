"""State checks of `k3x verify`: a runner's state held against the export's state contract, so a
decode that runs from the wrong state fails even when its tokens look plausible.

The parity harness (runtime/verify.py) lets each runner carry its own state; here every step hands the runner
the reference's TRUE state (a prefill, then `STATE_STEPS` decode steps of the reference's greedy tokens) and
judges what comes back:
- the state it returns, tensor by tensor, against the contract (model/state_contract.py): present, shape per
  sequence, dtype, finite; then against the reference's state after the step. A mismatch is named: a zeroed
  state, a transposed recurrent state (key and value axes swapped: same shape when K == V), the state it was
  given returned unchanged (not advanced), the state of one step earlier, or values that differ;
- its logits against the reference's continuation of the true state. When they differ, the reference is run
  from candidate wrong inputs (the KDA state zeroed, one step stale, or its recurrent transposed; in every KDA
  layer, then in each one alone) and the candidate whose logits the runner reproduces names what the runner
  really decoded from and in which layers.
The batch interface (past.* -> present.*) is run here (`reference_steps`); a serving export's steps (pools
in, a slot's new rows out) are built by runtime/serving_check.py and judged by the same `check_state`.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial
from typing import Any, Callable, Iterator

import torch
from torch import Tensor

from ..model.config import K3Config
from ..model.options import CacheOptions
from ..model.state_contract import KDA_KINDS, WRONG_STATES, tensor_label
from ..plan.dtypes import dtype_name, torch_dtype
from .base import Feeds, Runner
from .runners import next_feeds, start_feeds
from .tolerances import Tolerance
from .verify import compare

STATE_STEPS = 3  # decode steps after the prefill: a stale state (one step earlier) shows from the second on
Rerun = Callable[[int, Feeds], Feeds]  # the reference's outputs at step i from feeds made wrong (their logits)


@dataclass(frozen=True)
class StateFinding:
    backend: str
    step: int  # 0 = prefill
    what: str  # `layer 3 kda_recurrent`, `logits`
    problem: str

    def line(self) -> str:
        step = "prefill" if self.step == 0 else f"decode {self.step}"
        return f"{self.backend} {step}: {self.what}: {self.problem}"

    def to_json(self) -> dict[str, Any]:
        return {"backend": self.backend, "step": self.step, "what": self.what, "problem": self.problem}


def reference_steps(reference: Runner, cfg: K3Config, prompt: Tensor, steps: int, dtype: torch.dtype,
                    cache: CacheOptions | None) -> list[tuple[Feeds, Feeds]]:
    """(feeds, outputs) of the reference: the prefill of `prompt`, then `steps` greedy decode steps."""
    feeds, run = start_feeds(cfg, prompt, dtype, cache), []
    for _ in range(steps + 1):
        out = reference.infer(feeds)
        run.append((feeds, out))
        feeds = next_feeds(cfg, out, out["logits"][:, -1].argmax(-1, keepdim=True), cache)
    return run


def _close(a: Tensor, e: Tensor, dtype: Tolerance) -> bool:
    return compare(a, e, "", dtype).ok


def _contract_problem(t: dict[str, Any], got: Tensor | None, expected: Tensor) -> str | None:
    """What of `got` breaks the contract entry `t` (expected: the reference's tensor, for the position count)."""
    if got is None:
        return f"missing output {t['output']}"
    # a static cache's length: one for the batch; serving latents: this step's rows only, packed (no batch axis)
    lead = [] if t["kind"] == "length" or t.get("update") == "append" else [expected.shape[0]]
    shape = [*lead, *(expected.shape[len(lead) + i] if d == "position" else d for i, d in enumerate(t["shape"]))]
    if list(got.shape) != shape:
        axes = ", ".join(["batch"] * len(lead) + t["axes"])
        return f"shape {list(got.shape)}, the contract says {shape} (axes: {axes})"
    if got.dtype != torch_dtype(t["dtype"]):
        return f"dtype {dtype_name(got.dtype)}, the contract says {t['dtype']}"
    if got.is_floating_point() and not torch.isfinite(got).all():
        return "non-finite values"
    return None


def _given(t: dict[str, Any], feeds: Feeds) -> Tensor | None:
    """The state of the step's sequences that `feeds` hand in for contract entry `t`: the batch interface's
    input; a serving step's KDA pool rows of its slots; None for serving latents (the step returns only new
    positions, nothing to hold them against)."""
    if t.get("update") == "append":
        return None
    x = feeds[t["input"]]
    return x[feeds["slots"].long()] if "slots" in feeds else x


def _state_problem(t: dict[str, Any], got: Tensor, expected: Tensor, given: Tensor | None, before: Tensor | None,
                   dtype: Tolerance) -> str | None:
    """Why the returned state `got` is not the reference's `expected` (None when it is)."""
    got, expected = got.cpu(), expected.cpu()
    if _close(got, expected, dtype):
        return None
    if not got.any():
        return "returned a zeroed state"
    if t["kind"] == "kda_recurrent" and _close(got.transpose(-1, -2), expected, dtype):
        return "returned a transposed state (axes head, value, key; the contract says head, key, value)"
    if given is not None and given.shape == got.shape and _close(got, given.cpu(), dtype):
        return "returned the state it was given: not advanced by this step (stale)"
    if before is not None and before.shape == got.shape and _close(got, before.cpu(), dtype):
        return "returned the state of one step earlier (stale)"
    err = compare(got, expected, "", dtype)
    return f"differs from the reference's state (max_abs {err.max_abs:.3g})"


def _candidates(contract: dict[str, Any], feeds: Feeds, before: Feeds | None) -> Iterator[tuple[str, list[int], Feeds]]:
    """(kind, layers, feeds): `feeds` with the KDA state of `layers` made wrong in one way; all KDA layers
    first, then each alone. Candidates equal to the true feeds, and stale ones that are zeros, are left out."""
    carried = [t for t in contract["tensors"] if t["kind"] in KDA_KINDS]
    layers = sorted({t["layer"] for t in carried})
    for kind in WRONG_STATES:
        for chosen in [layers] + ([[i] for i in layers] if len(layers) > 1 else []):
            changed = {}
            for t in (t for t in carried if t["layer"] in chosen):
                x = feeds[t["input"]]
                if kind == "zeroed":
                    changed[t["input"]] = torch.zeros_like(x)
                elif kind == "stale" and before is not None:
                    changed[t["input"]] = before[t["input"]]
                elif kind == "transposed" and t["kind"] == "kda_recurrent":
                    changed[t["input"]] = x.transpose(-1, -2).contiguous()
            if any(not torch.equal(w, feeds[n]) for n, w in changed.items()) and \
                    not (kind == "stale" and not any(w.any() for w in changed.values())):
                yield kind, chosen, {**feeds, **changed}


def _logits_problem(rerun: Callable[[Feeds], Feeds], contract: dict[str, Any], got: Tensor, expected: Tensor, feeds: Feeds,
                    before: Feeds | None, dtype: Tolerance, seen: list[tuple[str, list[int]]]) -> str | None:
    """Why the runner's logits are not the reference's; `seen`: candidates that explained earlier steps,
    tried first (and the one that explains this step is added)."""
    got = got.cpu()
    if _close(got, expected.cpu(), dtype):
        return None
    candidates = sorted(_candidates(contract, feeds, before), key=lambda c: (c[0], c[1]) not in seen)
    for kind, layers, wrong in candidates:  # the reference from each wrong input: one eager step each
        if _close(got, rerun(wrong)["logits"].cpu(), dtype):
            seen.append((kind, layers))
            where = "layer" + ("s " if len(layers) > 1 else " ") + ", ".join(map(str, layers))
            return f"decoded from {WRONG_STATES[kind]} in {where}, not from the state it was given"
    err = compare(got, expected.cpu(), "", dtype)
    return f"differ from the reference's continuation of the state it was given (max_abs {err.max_abs:.3g})"


def check_state(reference: Runner, runner: Runner, cfg: K3Config, contract: dict[str, Any], *, prompt: Tensor,
                dtype: torch.dtype, cache: CacheOptions | None = None, steps: int = STATE_STEPS,
                run: list[tuple[Feeds, Feeds]] | None = None, rerun: Rerun | None = None,
                tolerance: Tolerance | None = None) -> list[StateFinding]:
    """Findings of `runner` handed the reference's true state at every step (empty: it keeps the contract).
    `run`: the reference's steps when already computed (`reference_steps`); `rerun`: the reference at a step
    from wrong feeds, when `run` is not the reference's own interface (a rank's share, runtime/rank_state.py);
    `tolerance`: the comparisons' key in runtime/tolerances.py (default `dtype`'s)."""
    run = run or reference_steps(reference, cfg, prompt, steps, dtype, cache)
    key = dtype if tolerance is None else tolerance
    rerun = rerun or (lambda _step, wrong: reference.infer(wrong))
    findings: list[StateFinding] = []
    seen: list[tuple[str, list[int]]] = []
    for step, (feeds, expected) in enumerate(run):
        before = run[step - 1][0] if step else None
        try:
            got = runner.infer(feeds)
        except Exception as e:  # noqa: BLE001 - a crash is a finding, named
            findings.append(StateFinding(runner.name, step, "<run>", f"{type(e).__name__}: {str(e)[:200]}"))
            break
        logits = _logits_problem(partial(rerun, step), contract, got["logits"], expected["logits"], feeds,
                                 before, key, seen)
        for t in contract["tensors"]:
            out, want = got.get(t["output"]), expected[t["output"]]
            problem = _contract_problem(t, out, want) or _state_problem(
                t, out, want, _given(t, feeds), None if before is None else _given(t, before), key)
            # a state computed from a wrong input the logits already name differs as a consequence
            if problem and not (logits and logits.startswith("decoded from") and problem.startswith("differs")):
                findings.append(StateFinding(runner.name, step, tensor_label(t), problem))
        if logits:
            findings.append(StateFinding(runner.name, step, "logits", logits))
    return findings
