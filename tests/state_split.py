"""Run by tests/runtime/test_state_file.py (and test_serving_state.py) as separate processes: one sequence
through the runtime API on pt2 and ort, prefill and decode in one process (`one`), or split by a state file
(`save` after the prefill, then `load` in another process). Writes the greedy tokens and the logits each token
was chosen from, per backend. A serving export is run by continuous batching (runtime/serve.serve).

    python tests/state_split.py one|save|load EXPORT STATE_PREFIX OUT NEW_TOKENS
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from k3x.folder.artifacts import ExportFolder
from k3x.runtime.runners import RunnerOptions, generate, make_runner, serving_entry
from k3x.runtime.serve import ServeOptions, serve, serving_runner
from k3x.runtime.state_file import serving_hooks, state_hooks, weights_origin
from k3x.text.sampling import SamplingOptions

PROMPT = [5, 17, 300, 2, 9, 41, 7]


class Recording:
    """The runner, recording the logits of each call's last position."""

    def __init__(self, inner, logits: list) -> None:
        self.inner, self.name, self.logits = inner, inner.name, logits

    def infer(self, feeds):
        out = self.inner.infer(feeds)
        self.logits.append(out["logits"][0, -1])
        return out


def split(mode: str, folder: Path, state: Path, out: Path, new_tokens: int = 6) -> dict[str, torch.Tensor]:
    """Run this script in a new process (the tests' way in) -> what it wrote."""
    r = subprocess.run([sys.executable, __file__, mode, str(folder), str(state), str(out), str(new_tokens)],
                       capture_output=True, text=True, timeout=600, env=os.environ.copy())
    assert r.returncode == 0, r.stderr[-3000:]
    return load_file(out)


def serving(mode: str, folder: ExportFolder, file: str, backend: str, new_tokens: int) -> dict[str, torch.Tensor]:
    ids, hooks = serving_hooks(file if mode == "save" else None, file if mode == "load" else None,
                               folder.state_contract(), folder.config(), PROMPT, origin=weights_origin(folder.manifest))
    options = ServeOptions(block_size=serving_entry(folder)["block_size"], keep_logits=True)
    (record,) = serve(serving_runner(backend, folder, RunnerOptions(provider="cpu")), folder.config(), [ids],
                      SamplingOptions(1 if mode == "save" else new_tokens), options, **hooks)
    return {f"{backend}.tokens": torch.tensor(record.tokens), f"{backend}.logits": torch.stack(record.logits)}


def main(mode: str, export: str, state: str, out: str, new_tokens: int) -> None:
    folder = ExportFolder.open(export)
    cfg, contract, results = folder.config(), folder.state_contract(), {}
    for backend in ("pt2", "ort"):
        file = f"{state}.{backend}.safetensors"
        if "serving" in folder.manifest:
            results |= serving(mode, folder, file, backend, new_tokens)
            continue
        ids, hooks = state_hooks(file if mode == "save" else None, file if mode == "load" else None, contract, cfg,
                                 PROMPT, origin=weights_origin(folder.manifest))
        logits = [hooks["start"]["logits"][0, -1]] if mode == "load" else []
        runner = Recording(make_runner(backend, folder, RunnerOptions(provider="cpu")), logits)
        g = generate(runner, cfg, torch.tensor([ids]), SamplingOptions(1 if mode == "save" else new_tokens),
                     dtype=folder.dtype(), cache=folder.options().cache, **hooks)
        results |= {f"{backend}.tokens": g.tokens[0].contiguous(), f"{backend}.logits": torch.stack(logits)}
    save_file(results, out)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], sys.argv[3], sys.argv[4], int(sys.argv[5]))
