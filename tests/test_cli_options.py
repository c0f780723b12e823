"""The CLI's surface before any work: every command's --help and bad arguments answer without importing
torch, --version, plain boolean flags, `-v` debug lines, the choice enums match the library's tables."""

from __future__ import annotations

import subprocess
import sys

import pytest
from typer.testing import CliRunner

from k3x import __version__
from k3x.cli import app
from k3x.cli_flags import Backend, Runtime

COMMANDS = ("init-checkpoint", "inspect", "export", "build-engine", "build-ort-kernels", "generate", "run", "logits",
            "verify")

NO_TORCH = r'''
import sys
from typer.testing import CliRunner
from k3x.cli import app
runner = CliRunner()
for args in {cases!r}:
    r = runner.invoke(app, args)
    print(r.exit_code, r.output.replace("\n", " | "))
print("torch loaded" if "torch" in sys.modules else "no torch")
'''


def _fresh(cases: list[list[str]]) -> list[str]:
    r = subprocess.run([sys.executable, "-c", NO_TORCH.format(cases=cases)], capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]
    return r.stdout.splitlines()


def test_every_help_answers_without_torch_and_shows_no_bool_placeholder():
    lines = _fresh([[c, "--help"] for c in COMMANDS])
    assert lines[-1] == "no torch", lines[-1]
    for command, line in zip(COMMANDS, lines):
        assert line.startswith("0 ") and "<bool>" not in line, (command, line)
    assert "--chat " in lines[COMMANDS.index("run")] and "--tokenizer / --no-tokenizer" in lines[0]


@pytest.mark.parametrize("args", [["run", "missing-folder"], ["verify", "missing-folder"],
                                  ["build-engine", "missing-folder"], ["generate", "--checkpoint", "missing-folder"],
                                  ["inspect", "--checkpoint", "missing-folder"]])
def test_a_missing_folder_is_named_before_torch_loads(args):
    code_and_output, torch_line = _fresh([args])
    assert code_and_output.startswith("1 error: missing-folder: does not exist"), code_and_output
    assert torch_line == "no torch"


def test_a_bad_choice_is_refused_before_torch_loads(tmp_path):
    code_and_output, torch_line = _fresh([["run", str(tmp_path), "--backend", "onnx"]])
    assert code_and_output.startswith("2 ") and "onnx" in code_and_output and torch_line == "no torch"


def test_version():
    r = CliRunner().invoke(app, ["--version"])
    assert r.exit_code == 0 and r.output.strip() == f"k3x {__version__}"


def test_verbose_prints_debug_lines_only_when_asked():
    def stderr(*flags: str) -> str:
        r = subprocess.run([sys.executable, "-m", "k3x", "inspect", "--preset", "k3-mini", *flags],
                           capture_output=True, text=True, timeout=120)
        assert r.returncode == 0, r.stderr[-1000:]
        return r.stderr

    loud = stderr("-v")
    assert "config k3-mini (hash " in loud and "from preset k3-mini" in loud and "inspect: " in loud, loud
    assert "config k3-mini" not in stderr()


def test_choices_match_the_library_tables():
    from k3x.exporter.engine import RUNTIMES
    from k3x.runtime.runners import RUNNERS

    assert {b.value for b in Backend} == set(RUNNERS)
    assert {r.value for r in Runtime} == {"auto", *RUNTIMES}
