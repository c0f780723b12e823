"""A sequence's state handed across processes (issue 21): prefill in one process, the state written to a file
(safetensors, runtime/state_file.py), decode in another: the continuation's tokens and logits are
bit-identical to one process doing both, on pt2 and ort. Through `k3x run --save-state / --load-state` too,
and a file that does not fit the export is refused in one line."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file
from safetensors import safe_open
from typer.testing import CliRunner

from k3x.cli import app
from onnx_mini_folder import mini_export
from state_split import split

pytest.importorskip("onnxruntime")
cli = CliRunner()


def test_prefill_and_decode_in_two_processes_equal_one_process_bit_for_bit(tmp_path):
    folder = mini_export().folder
    one = split("one", folder, tmp_path / "unused", tmp_path / "one.safetensors")
    split("save", folder, tmp_path / "state", tmp_path / "save.safetensors")
    two = split("load", folder, tmp_path / "state", tmp_path / "two.safetensors")
    for backend in ("pt2", "ort"):
        assert one[f"{backend}.tokens"].tolist() == two[f"{backend}.tokens"].tolist() and \
            len(two[f"{backend}.tokens"]) == 6, backend
        assert torch.equal(one[f"{backend}.logits"], two[f"{backend}.logits"]), backend  # bit-identical


def run(*args) -> tuple[int, str]:
    r = cli.invoke(app, ["run", str(mini_export().folder), "--backend", "pt2", *map(str, args)])
    return r.exit_code, r.output


def tokens_of(output: str) -> str:
    return next(line for line in output.splitlines() if line.startswith("tokens: "))


def test_cli_saves_after_the_prefill_and_decodes_from_the_file(tmp_path):
    state = tmp_path / "s.safetensors"
    code, whole = run("--prompt-ids", "3,1,4,1,5", "--max-new-tokens", "5")
    assert code == 0, whole
    code, out = run("--prompt-ids", "3,1,4,1,5", "--max-new-tokens", "1", "--save-state", state)
    assert code == 0 and state.is_file(), out
    with safe_open(str(state), framework="pt") as f:
        assert f.metadata()["format"] == "k3x-state"
        assert f.get_tensor("tokens").tolist() == [3, 1, 4, 1, 5]
        assert list(f.get_tensor("layer.0.kda_recurrent").shape) == [4, 16, 16]
        assert list(f.get_tensor("layer.2.mla_latent").shape) == [5, 32]
    code, out = run("--load-state", state, "--max-new-tokens", "5")
    assert code == 0 and tokens_of(out) == tokens_of(whole), out


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> Path:
    """The state of prompt 3,1,4,1,5 after its prefill (pt2), saved once for the refusal tests."""
    state = tmp_path_factory.mktemp("state") / "s.safetensors"
    assert run("--prompt-ids", "3,1,4,1,5", "--max-new-tokens", "1", "--save-state", state)[0] == 0
    return state


def _edit(state: Path, out: Path, change) -> Path:
    with safe_open(str(state), framework="pt") as f:
        tensors, meta = {k: f.get_tensor(k) for k in f.keys()}, f.metadata()
    change(tensors, meta)
    save_file(tensors, out, metadata=meta)
    return out


@pytest.mark.parametrize("change,message", [
    (lambda t, m: t.update({"layer.0.kda_recurrent": t["layer.0.kda_recurrent"][:, :8].contiguous()}),
     "layer.0.kda_recurrent: shape [4, 8, 16], the export's contract says [4, 16, 16]"),
    (lambda t, m: t.update({"layer.3.kda_conv": t["layer.3.kda_conv"].bfloat16()}),
     "layer.3.kda_conv: dtype bf16, the export's contract says fp32"),
    (lambda t, m: t.update({"layer.2.mla_latent": t["layer.2.mla_latent"][:3].contiguous()}),
     "layer.2.mla_latent: shape [3, 32], the export's contract says [5, 32]"),
    (lambda t, m: m.update(config_hash="0" * 64), "saved by an export of another model"),
    (lambda t, m: m.update(contract=m["contract"].replace('"key", "value"', '"value", "key"', 1)),
     "layer 0 kda_recurrent: its contract says axes=['head', 'value', 'key']"),
    (lambda t, m: t.pop("layer.4.mla_latent"), "layer.4.mla_latent: missing"),
    (lambda t, m: t.update(extra=torch.zeros(1)), "extra: not a tensor of this export's state contract"),
])
def test_a_state_file_that_does_not_fit_is_refused_in_one_line(saved, tmp_path, change, message):
    bad = _edit(saved, tmp_path / "bad.safetensors", change)
    code, out = run("--load-state", bad, "--max-new-tokens", "2")
    assert code == 1 and message in out and len(out.strip().splitlines()) == 1, out


def test_a_pickle_is_not_a_state_file_and_flags_are_checked(tmp_path):
    pickled = tmp_path / "s.pt"
    torch.save({"x": torch.zeros(1)}, pickled)
    code, out = run("--load-state", pickled)
    assert code == 1 and "not a k3x state file" in out and len(out.strip().splitlines()) == 1, out
    code, out = run("--load-state", pickled, "--prompt-ids", "1,2")
    assert code == 1 and "not both" in out, out
    code, out = run("--save-state", tmp_path / "no-such-folder" / "s.safetensors")
    assert code == 1 and "no-such-folder does not exist" in out and len(out.strip().splitlines()) == 1, out
