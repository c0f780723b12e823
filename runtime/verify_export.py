"""`k3x verify`: parity of every backend of an export against the eager reference over a prefill and decode
steps (any rank count), and each backend's state against the export's state contract (runtime/state_check.py;
rank programs: each rank's share against its folder's, runtime/rank_state.py). The speaking rank prints the
table and the state verdict and optionally writes them as JSON; the command exits 1 on any failure."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

from ..console import echo, fail, one_line
from ..fileio import check_output, write_output
from ..folder.artifacts import ExportFolder
from . import session as sessions
from .command_session import close_session, open_session
from .runners import RunnerError, RunnerOptions, make_runner
from .serving_check import verify_serving
from .session import Verdict


def verify_export(export_dir: Path, backends: list[str], options: RunnerOptions, *, steps: int, prompt_len: int,
                  batch: int, seed: int, json_out: Path | None) -> bool:
    """`k3x verify`: prints the table and the state verdict (the speaking rank), optionally writes them as JSON;
    True when every backend and every state check passed."""
    if json_out is not None:  # before any work
        check_output(json_out, flag="--json", inputs=_inputs(export_dir, options), stream=True)
    folder = ExportFolder.open(export_dir)
    folder.config()  # a k3x export whose config builds
    if "serving" in folder.manifest:
        return verify_serving_export(folder, backends, options, steps, prompt_len, seed, json_out)
    s = open_session(export_dir, backends, options)
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
            write_output(json_out, (json.dumps(verdict.to_json(s, names), indent=2) + "\n").encode(), flag="--json",
                         inputs=_inputs(export_dir, options), stream=True)
    close_session(s)
    return verdict.ok


def verify_serving_export(folder: ExportFolder, backends: list[str], options: RunnerOptions, steps: int,
                          prompt_len: int, seed: int, json_out: Path | None) -> bool:
    """A serving export: its step against the eager serving step, the true state handed in at every step, and
    the state checks on the pools (runtime/serving_check.py)."""
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
        write_output(json_out, (json.dumps(out, indent=2) + "\n").encode(), flag="--json",
                     inputs=_inputs(folder.path, options), stream=True)
    return verdict.ok


def _inputs(export_dir: Path, options: RunnerOptions) -> list[tuple[str, Path | None]]:
    """The files `--json` may not replace: the export's, the reference checkpoint's (fileio.check_output)."""
    return [("the export", export_dir), ("--checkpoint", options.checkpoint)]
