"""State files (`k3x run --save-state / --load-state`, runtime/state_file.py) carry their origin: a state of
another export's weights is refused, as are NaN / inf values, a sequence longer than the model's context and
anything but a regular file (a FIFO is refused, never waited on). Each is one line, exit 1."""

from __future__ import annotations

import math
import time
from pathlib import Path

import pytest
import torch
from hostile_util import edit_manifest, k3x, released_fifo
from safetensors import safe_open
from safetensors.torch import save_file

PROMPT = "3,1,4,1,5"


@pytest.fixture(scope="module")
def saved(built, tmp_path_factory) -> Path:
    """The state of PROMPT after its prefill on the session's pt2 + ONNX export (pt2), saved once."""
    state = tmp_path_factory.mktemp("state") / "s.safetensors"
    code, out = k3x("run", built / "export", "--backend", "pt2", "--prompt-ids", PROMPT, "--max-new-tokens", "1",
                    "--save-state", state)
    assert code == 0, out
    return state


def _edit(state: Path, out: Path, change) -> Path:
    with safe_open(str(state), framework="pt") as f:
        tensors, meta = {k: f.get_tensor(k) for k in f.keys()}, f.metadata()
    change(tensors)
    save_file(tensors, out, metadata=meta)
    return out


def _refused(out: str, *says: str) -> bool:
    return out.strip().count("\n") == 0 and "Traceback" not in out and all(s in out for s in says)


def test_a_state_of_another_exports_weights_is_refused(built, export_dir, saved):
    code, out = k3x("run", built / "export", "--backend", "pt2", "--load-state", saved, "--max-new-tokens", "2")
    assert code == 0, out  # its own export decodes it
    # the same architecture exported from another checkpoint: the manifest records that checkpoint's hash
    edit_manifest(export_dir, lambda m: m["checkpoint"].update(hash="0123456789abcdef"))
    code, out = k3x("run", export_dir, "--backend", "pt2", "--load-state", saved, "--max-new-tokens", "2")
    assert code == 1 and _refused(out, "saved by an export of other weights", "0123456789abcdef"), out


@pytest.mark.parametrize("name,value", [("layer.0.kda_recurrent", math.nan), ("layer.2.mla_latent", math.inf),
                                        ("logits", -math.inf)])
def test_nan_or_inf_in_a_state_is_refused(built, saved, tmp_path, name, value):
    def poison(t):
        t[name].view(-1)[3] = value

    bad = _edit(saved, tmp_path / "bad.safetensors", poison)
    code, out = k3x("run", built / "export", "--backend", "pt2", "--load-state", bad, "--max-new-tokens", "2")
    assert code == 1 and _refused(out, f"{name}: holds NaN or inf"), out


@pytest.fixture(scope="module")
def served(serving_export, tmp_path_factory) -> Path:
    """The state of PROMPT after its prefill on the session's serving export (pt2), saved once."""
    state = tmp_path_factory.mktemp("served") / "s.safetensors"
    code, out = k3x("run", serving_export, "--backend", "pt2", "--prompt-ids", PROMPT, "--max-new-tokens", "1",
                    "--save-state", state)
    assert code == 0, out
    return state


@pytest.mark.parametrize("path", ["batch", "serving"])
def test_a_state_longer_than_the_context_is_refused(request, built, serving_export, path, tmp_path):
    positions = 4097  # k3-mini's context is 4096
    export, state = (built / "export", "saved") if path == "batch" else (serving_export, "served")

    def lengthen(t):
        t["tokens"] = torch.ones(positions, dtype=torch.int64)
        for k in [k for k in t if k.endswith("mla_latent")]:
            t[k] = torch.cat([t[k], torch.zeros(positions - t[k].shape[0], t[k].shape[1])])

    bad = _edit(request.getfixturevalue(state), tmp_path / "long.safetensors", lengthen)
    code, out = k3x("run", export, "--backend", "pt2", "--load-state", bad, "--max-new-tokens", "1")
    assert code == 1 and _refused(out, "4097 positions, over the model's context (4096)"), out


def test_a_fifo_as_the_state_file_is_refused_without_waiting(built, tmp_path):
    with released_fifo(tmp_path / "s.safetensors") as waited:
        t0 = time.monotonic()
        code, out = k3x("run", built / "export", "--backend", "pt2", "--load-state", tmp_path / "s.safetensors",
                        "--max-new-tokens", "2")
        assert not waited(), f"waited on the FIFO {time.monotonic() - t0:.1f} s"
    assert code == 1 and _refused(out, "not a regular file"), out


def test_a_state_file_larger_than_any_state_of_the_context_is_not_read(built, tmp_path):
    big = tmp_path / "big.safetensors"
    with open(big, "wb") as f:
        f.truncate(1 << 40)  # sparse: a terabyte that would be read into memory
    code, out = k3x("run", built / "export", "--backend", "pt2", "--load-state", big, "--max-new-tokens", "2")
    assert code == 1 and _refused(out, "more than a state of this export's context can take"), out


def test_the_serving_path_checks_the_same(serving_export, saved, tmp_path):
    """A serving export (runtime/session.serving_state) reads the same file under the same checks: the batch
    export's state (same architecture and per-sequence contract, other weights) and a FIFO are refused."""
    code, out = k3x("run", serving_export, "--backend", "pt2", "--load-state", saved, "--max-new-tokens", "2")
    assert code == 1 and _refused(out, "saved by an export of other weights"), out
    with released_fifo(tmp_path / "s.safetensors") as waited:
        code, out = k3x("run", serving_export, "--backend", "pt2", "--load-state", tmp_path / "s.safetensors",
                        "--max-new-tokens", "2")
        assert not waited(), "waited on the FIFO"
    assert code == 1 and _refused(out, "not a regular file"), out
