"""`k3x verify` on a serving export (`k3x export --serving`, one program): the serving step of every backend
against the eager model's serving step (model/serving.py K3ServingStep over the checkpoint), with the state
checks of runtime/state_check.py on the step's pools.

One sequence in slot 1 of 2 (the other slot, every unused latent block and the pools' spare rows hold random
values, so a step that reads the wrong slot, block or position shows), its latent blocks not starting at
block 0: a prefill of the prompt, then `steps` decode steps of the reference's greedy tokens. Every step
hands each backend the pools holding the reference's TRUE state (as the serving runtime holds it: the slot's
KDA rows, the sequence's latent rows in its blocks) and judges what comes back:
- parity: logits and every `new.*` output against the reference's (the table `k3x verify` prints);
- the state contract (runtime/state_check.check_state): the returned rows' shape per sequence, dtype,
  finiteness, against the reference's state, and, when the logits differ, which wrong KDA state (zeroed,
  one step stale, transposed; all KDA layers or one) the backend really decoded from.
"""

from __future__ import annotations

import time

import torch

from ..folder.artifacts import ExportFolder
from ..model.serving import K3ServingStep
from ..model.state import blocks_for
from .base import Feeds, Runner, RunnerError, RunnerOptions
from .pools import StatePools
from .runners import make_runner, runnable, serving_entry
from .scheduler import pack_feeds
from .serve import StepModuleRunner, serving_runner
from .state_check import STATE_STEPS, StateFinding, check_state
from .tolerances import Tolerance, parity_key
from .verify import OutputError, StepReport, VerifyReport, compare

SLOT = 1  # the checked sequence's slot (of 2): slot 0 holds noise


def serving_reference(folder: ExportFolder, options: RunnerOptions) -> StepModuleRunner:
    """The eager serving step over the export's checkpoint (the checks of the eager runner: hash, config)."""
    model = make_runner("eager", folder, options).module
    step = K3ServingStep(model)
    return StepModuleRunner("eager", step, step.input_names, step.output_names)


def serving_steps(reference: Runner, cfg, prompt: list[int], steps: int, dtype: torch.dtype, block_size: int,
                  seed: int = 0) -> list[tuple[Feeds, Feeds]]:
    """(feeds with the pools before the step, the reference's outputs): the prefill of `prompt` in slot
    `SLOT`, then `steps` greedy decode steps; the pools start as noise but for the sequence's own slot."""
    positions = len(prompt) + steps
    blocks = blocks_for(positions, block_size) + 2
    pools = StatePools(cfg, slots=2, blocks=blocks, block_size=block_size, dtype=dtype)
    gen = torch.Generator().manual_seed(seed)
    for t in pools.tensors.values():
        t.copy_(torch.randn(t.shape, generator=gen).to(t.dtype))
    pools.reset_slot(SLOT)
    table = list(range(2, blocks))  # not from block 0: a step must read through the table
    run, tokens, past = [], list(prompt), 0
    for _ in range(steps + 1):
        width = blocks_for(past + len(tokens), block_size)
        feeds = pack_feeds([tokens], [past], [SLOT], [table[:width]], [(0, 1)])
        feeds.update({n: t.clone() for n, t in pools.tensors.items()})
        out = reference.infer(feeds)
        run.append((feeds, out))
        pools.write_back(feeds, out)
        past, tokens = past + len(tokens), [int(out["logits"][-1].argmax())]
    return run


def _parity(run: list[tuple[Feeds, Feeds]], runner: Runner, dtype: Tolerance) -> list[StepReport]:
    """Each step of `run` on `runner` (the true state handed in), every output compared with the reference's."""
    reports = []
    for step, (feeds, expected) in enumerate(run):
        t0 = time.perf_counter()
        try:
            out = runner.infer(feeds)
        except Exception as e:  # noqa: BLE001 - a crash is a failed step, reported by name
            return reports + [StepReport(runner.name, step, 0.0, [OutputError(
                "<run>", float("inf"), float("inf"), False, f"{type(e).__name__}: {str(e)[:200]}")])]
        seconds = time.perf_counter() - t0
        reports.append(StepReport(runner.name, step, seconds,
                                  [compare(out.get(n), e, n, dtype) for n, e in expected.items()]))
    return reports


def verify_serving(folder: ExportFolder, backends: list[str], options: RunnerOptions, *, steps: int,
                   prompt_len: int, seed: int) -> tuple[list[str], VerifyReport, list[StateFinding]]:
    """(the backends checked, parity over the prefill and `steps` decode steps, the state findings over the
    prefill and `STATE_STEPS` decode steps) of a one-program serving export."""
    if "parallel" in folder.manifest:
        raise RunnerError(f"{folder.path}: verify checks one-program serving exports; a rank serving export is "
                          "checked by serving prompts on its ranks (k3x run --prompts)")
    if steps < 0 or prompt_len < 1:
        raise ValueError(f"steps={steps}, prompt_len={prompt_len}: need steps >= 0, prompt_len >= 1")
    names = backends or runnable(folder.manifest, ("pt2", "aoti", "ort", "trt"))
    if "trt" in names and not backends and not torch.cuda.is_available():
        names = [n for n in names if n != "trt"]
    cfg, dtype, block = folder.config(), folder.dtype(), int(serving_entry(folder)["block_size"])
    runners = [serving_runner(b, folder, options) for b in names]
    reference = serving_reference(folder, options)
    prompt = torch.randint(0, cfg.vocab_size, (prompt_len,), generator=torch.Generator().manual_seed(seed)).tolist()
    run = serving_steps(reference, cfg, prompt, max(steps, STATE_STEPS), dtype, block, seed)
    key = parity_key(dtype, folder.options().build.trunk)
    report = VerifyReport(key, [s for r in runners for s in _parity(run[: steps + 1], r, key)])
    contract = folder.state_contract()
    findings = [f for r in runners for f in check_state(reference, r, cfg, contract, prompt=torch.tensor([prompt]),
                                                        dtype=dtype, run=run[: STATE_STEPS + 1], tolerance=key)]
    return names, report, findings
