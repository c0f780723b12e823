"""CPU trunk combinations that cannot be (`k3x export --trunk bf16 | int8`), and a tampered trunk in a manifest:
each one `error:` line naming the flag or the field, exit 1, nothing written."""

from __future__ import annotations

import shutil

import pytest
from hostile_util import edit_manifest, k3x

REFUSED = [
    (["--preset", "k3-mini", "--trunk", "int8", "--dtype", "bf16"],
     "--trunk int8: the activations are fp32 (the projections' weights are int8); drop --dtype bf16"),
    (["--preset", "k3-mini", "--trunk", "bf16", "--tp", "2"], "--trunk bf16: not for rank programs (--tp/--ep)"),
    (["--preset", "k3-mini", "--trunk", "int8", "--ep", "2"], "--trunk int8: not for rank programs (--tp/--ep)"),
    (["--checkpoint", "CKPT", "--trunk", "bf16", "--weights", "reference"],
     "--trunk bf16: the trunk's weights are written at export (bf16 or quantised), not read from the checkpoint"),
]


@pytest.mark.parametrize("flags,expected", REFUSED, ids=[" ".join(f[2:]) for f, _ in REFUSED])
def test_a_trunk_that_cannot_be_is_one_line_and_writes_nothing(built, tmp_path, flags, expected):
    out = tmp_path / "out"
    flags = [str(built / "ckpt") if f == "CKPT" else f for f in flags]
    code, text = k3x("export", *flags, "--target", "onnx", "--out", out)
    errors = [line for line in text.splitlines() if line.startswith("error")]
    assert code == 1 and len(errors) == 1 and expected in errors[0] and "CRASH" not in text, text
    assert not out.exists()


@pytest.mark.parametrize("command", [["verify"], ["run", "--prompt-ids", "1,2", "--max-new-tokens", "1"]])
def test_a_tampered_trunk_in_the_manifest_is_one_line(trunk_exports, tmp_path, command):
    folder = tmp_path / "int8"
    shutil.copytree(trunk_exports / "int8", folder)
    edit_manifest(folder, lambda m: m["options"].update(trunk="int4\x1b[2J"))
    code, text = k3x(command[0], folder, *command[1:])
    errors = [line for line in text.splitlines() if line.startswith("error")]
    assert code == 1 and len(errors) == 1 and "CRASH" not in text, text
    assert "options: trunk='int4\\x1b[2J': must be 'dense', 'bf16' or 'int8'" in errors[0]
