"""One presets table: the torch-free mirror (exporter/presets.py) names exactly the registry's presets, every
command that takes `--preset` shows the same list in its --help, and the README's `## Presets` table is the one
`presets_markdown` makes from the registry (absent or stale, the test fails)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from typer.testing import CliRunner

from k3x.cli import app
from k3x.exporter.presets import PRESET_HELP, PRESET_NAMES, PRESET_USES, model_dtype, presets_markdown
from k3x.model.config import PRESETS, ConfigError

README = Path(__file__).resolve().parents[2] / "README.md"
COMMANDS = ("init-checkpoint", "inspect", "export", "build-engine", "build-ort-kernels", "generate", "run", "logits",
            "verify")


def test_the_torch_free_names_are_the_registry_in_its_order():
    assert PRESET_NAMES == tuple(PRESETS) and "kimi-linear-mid" in PRESET_NAMES
    assert {u.dtype for u in PRESET_USES.values()} <= {"fp32", "bf16"}


def _flat(text: str) -> str:
    return " ".join(text.replace("-\n", "-").split())  # help text as one line, however typer wrapped it


def test_every_preset_flag_shows_the_one_list():
    with_preset = []
    for command in COMMANDS:
        r = CliRunner().invoke(app, [command, "--help"], terminal_width=200)
        assert r.exit_code == 0, r.output
        if "--preset" in r.output:
            with_preset.append(command)
            assert _flat(PRESET_HELP) in _flat(r.output), (command, r.output)
    assert with_preset == ["init-checkpoint", "inspect", "export"]
    assert all(name in PRESET_HELP for name in PRESETS)


def test_the_readme_presets_table_is_the_registry():
    text = README.read_text()
    tables = re.findall(r"(?m)^\| preset \|.*\n(?:\|.*\n?)*", text)
    assert len(tables) == 1, "README.md needs exactly one table with the header `| preset |` (under ## Presets)"
    assert "## Presets\n\n" + tables[0].rstrip("\n") in text
    assert tables[0].rstrip("\n") == presets_markdown()


def test_auto_dtype_of_a_preset_is_its_default():
    assert model_dtype("auto", "k3-mini", None) == ("fp32", "auto: preset k3-mini's default")  # the tests' exports
    assert model_dtype("auto", "k3", None)[0] == "bf16"  # as published
    assert model_dtype("bf16", "k3-mini", None) == ("bf16", "--dtype")
    with pytest.raises(ConfigError, match="preset='k9': unknown; valid presets: k3, k3-bench"):
        model_dtype("auto", "k9", None)


def test_auto_dtype_of_a_preset_registered_at_run_time(monkeypatch):
    monkeypatch.setitem(PRESETS, "k3-mine", PRESETS["k3-mini"])
    assert model_dtype("auto", "k3-mine", None) == ("fp32", "auto: preset k3-mine names no default dtype")
