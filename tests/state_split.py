"""Run by tests/runtime/test_state_file.py as separate processes: one sequence through the runtime API on pt2
and ort, prefill and decode in one process (`one`), or split by a state file (`save` after the prefill, then
`load` in another process). Writes the greedy tokens and the logits each token was chosen from, per backend.

    python tests/state_split.py one|save|load EXPORT STATE_PREFIX OUT NEW_TOKENS
"""

from __future__ import annotations

import sys

import torch
from safetensors.torch import save_file

from k3x.folder.artifacts import ExportFolder
from k3x.runtime.runners import RunnerOptions, generate, make_runner
from k3x.runtime.state_file import state_hooks
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


def main(mode: str, export: str, state: str, out: str, new_tokens: int) -> None:
    folder = ExportFolder.open(export)
    cfg, contract, results = folder.config(), folder.state_contract(), {}
    for backend in ("pt2", "ort"):
        file = f"{state}.{backend}.safetensors"
        ids, hooks = state_hooks(file if mode == "save" else None, file if mode == "load" else None, contract, cfg,
                                 PROMPT)
        logits = [hooks["start"]["logits"][0, -1]] if mode == "load" else []
        runner = Recording(make_runner(backend, folder, RunnerOptions(provider="cpu")), logits)
        g = generate(runner, cfg, torch.tensor([ids]), SamplingOptions(1 if mode == "save" else new_tokens),
                     dtype=folder.dtype(), cache=folder.options().cache, **hooks)
        results |= {f"{backend}.tokens": g.tokens[0].contiguous(), f"{backend}.logits": torch.stack(logits)}
    save_file(results, out)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], sys.argv[3], sys.argv[4], int(sys.argv[5]))
