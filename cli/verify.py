"""`k3x verify`: parity of every backend of an export against the eager reference over a prefill and decode
steps (any rank count), and each backend's state against the export's state contract (runtime/state_check.py;
rank programs: each rank's share against its folder's, runtime/rank_state.py); prints the table and the state verdict, optionally writes them as JSON, exits 1 on
any failure."""

from __future__ import annotations

import dataclasses
import json

import typer

from .app import app
from .console import echo, fail, one_line
from .options import Backends, Batch, CudaGraph, ExportDir, JsonReport, OrtProvider, PromptLen, PromptSeed, \
    Provider, ReferenceCheckpoint, SkipHashCheck, Steps
from .run import close_session, open_session, runner_options


@app.command()
def verify(export_dir: ExportDir, backends: Backends = "", steps: Steps = 8, prompt_len: PromptLen = 7,
           batch: Batch = 1, seed: PromptSeed = 0, checkpoint: ReferenceCheckpoint = None,
           provider: OrtProvider = Provider.AUTO, json_out: JsonReport = None, skip_hash_check: SkipHashCheck = False,
           cuda_graph: CudaGraph = False) -> None:
    """Parity of every backend vs the eager reference over prefill + decode steps; exit 1 on any failure."""
    from ..folder.artifacts import ExportFolder, atomic_write_bytes
    from ..runtime import session as sessions
    from ..runtime.runners import RunnerError, make_runner

    folder = ExportFolder.open(export_dir)
    folder.config()  # a k3x export whose config builds
    options = runner_options(provider, skip_hash_check, checkpoint, cuda_graph)
    if "serving" in folder.manifest:
        return _verify_serving(folder, [b.strip() for b in backends.split(",") if b.strip()], options, steps,
                               prompt_len, seed, json_out)
    s = open_session(export_dir, [b.strip() for b in backends.split(",") if b.strip()], options)
    names = list(s.runners)
    if not names:
        fail(f"{export_dir}: no runnable artifact (exported with --no-weights?); name runners with --backends")
    try:
        sessions.check(s, batch=batch, prompt_len=prompt_len, new_tokens=steps + 1, backends=["eager"] + names)
        reference = make_runner("eager", export_dir, dataclasses.replace(options, device="cpu", cuda_graph=False))
        verdict = sessions.verify_session(s, reference, names, steps=steps, batch=batch, prompt_len=prompt_len,
                                          seed=seed)
    except RunnerError as e:
        fail(f"{s.who}{e}")
    except Exception as e:  # noqa: BLE001 - e.g. the eager reference failing: one line, no traceback
        fail(f"{s.who or 'verify: '}{one_line(e)}")
    if s.speaks:
        echo("\n".join([f"{r.name}: provider {r.provider}" for r in s.runners.values() if hasattr(r, "provider")]
                       + [verdict.report.table()] + ([verdict.greedy_line(steps + 1)] if verdict.greedy else [])
                       + verdict.state_lines()))
        if json_out:
            atomic_write_bytes(json_out, (json.dumps(verdict.to_json(s, names), indent=2) + "\n").encode())
    close_session(s)
    if not verdict.ok:
        raise typer.Exit(code=1)


def _verify_serving(folder, backends: list[str], options, steps: int, prompt_len: int, seed: int, json_out) -> None:
    """A serving export: its step against the eager serving step, the true state handed in at every step, and
    the state checks on the pools (runtime/serving_check.py)."""
    from ..folder.artifacts import atomic_write_bytes
    from ..runtime.runners import RunnerError
    from ..runtime.serving_check import verify_serving
    from ..runtime.session import Verdict

    try:
        names, report, findings = verify_serving(folder, backends, dataclasses.replace(options, cuda_graph=False),
                                                 steps=steps, prompt_len=prompt_len, seed=seed)
    except (RunnerError, ValueError) as e:
        fail(str(e))
    except Exception as e:  # noqa: BLE001 - one line, no traceback
        fail(f"verify: {one_line(e)}")
    verdict = Verdict(report, state=findings)
    echo("\n".join(["serving step: the true state handed in at every step", report.table(),
                    *verdict.state_lines()]))
    if json_out:
        out = verdict.report.to_json() | {"backends": names, "state_ok": not findings,
                                          "state_findings": [f.to_json() for f in findings]}
        atomic_write_bytes(json_out, (json.dumps(out, indent=2) + "\n").encode())
    if not verdict.ok:
        raise typer.Exit(code=1)
