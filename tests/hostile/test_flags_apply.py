"""Every flag of `run`, `verify` and `inspect`, on each export kind (batch, serving): it applies, or the command
is refused in one line naming it (exit 1), never silently ignored.

"Applies" is observed where the command hands over to the library: the library entry (`decode_export` /
`run_prompts` / `verify_export`) is replaced by a recorder, and the call with the flag must differ from the
call without it (a flag the command drops leaves the call as it was); `inspect` prints, so its output must
differ. A flag that needs a companion (`--seed` needs `--temperature`, `--prefix-cache-mb` needs
`--prefix-cache`, ...) is tried alone (refused, or applying) and with its companion (applying). The tables
must name every parameter of each command, so a new flag is walked too. In-process, no model is loaded:
each case takes milliseconds.
"""

from __future__ import annotations

import dataclasses
import enum
import json
from pathlib import Path

import pytest
import typer.main
from hostile_util import cli

from k3x.cli import app

COMMANDS = typer.main.get_command(app).commands


def _norm(x):
    """A call's arguments as plain data (objects without data: their type), to compare two calls."""
    if dataclasses.is_dataclass(x) and not isinstance(x, type):
        return {f.name: _norm(getattr(x, f.name)) for f in dataclasses.fields(x)}
    if isinstance(x, dict):
        return {str(k): _norm(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_norm(v) for v in x]
    if isinstance(x, enum.Enum):
        return x.value
    if x is None or isinstance(x, (bool, int, float, str)):
        return x
    return str(x) if isinstance(x, Path) else type(x).__name__


@pytest.fixture()
def recorded(monkeypatch):
    """The library calls the commands make, recorded instead of run."""
    from k3x.runtime import command_session, serve_prompts, verify_export

    calls = []

    def record(name, result=None):
        def call(*args, **kwargs):
            calls.append((name, _norm(args), _norm(kwargs)))
            return result
        return call

    monkeypatch.setattr(command_session, "decode_export", record("decode_export"))
    monkeypatch.setattr(serve_prompts, "run_prompts", record("run_prompts"))
    monkeypatch.setattr(verify_export, "verify_export", record("verify_export", True))
    return calls


def _invoke(args, calls):
    del calls[:]
    r = cli.invoke(app, [str(a) for a in args])
    return r, json.dumps(calls, sort_keys=True, default=str) + r.output * (args[0] == "inspect")


def _refused_naming(r, name: str, opt: str) -> bool:
    lines = [ln for ln in r.output.strip().splitlines() if not ln.startswith("note: ")]
    return (r.exit_code == 1 and r.exception is None or isinstance(r.exception, SystemExit)) and r.exit_code == 1 \
        and len(lines) == 1 and lines[0].startswith("error: ") and len(lines[0]) < 300 \
        and (opt in lines[0] or name in lines[0])


def _walk(base: list, name: str, opt: str, flag: list, companion: list, calls) -> list[str]:
    """'applies' or 'refused' for `flag` alone, then with `companion` (where the companion applies), over the
    command line `base`; fails otherwise."""
    outcomes = []
    for extra in ([flag] + ([companion + flag] if companion else [])):
        plain, want = _invoke(base + (companion if extra is not flag else []), calls)
        if plain.exit_code != 0:  # the companion itself does not apply here: the flag alone is what is walked
            assert extra is flag or _refused_naming(plain, "", companion[0]), plain.output
            continue
        r, got = _invoke(base + extra, calls)
        if r.exit_code == 0:
            assert got != want, f"{opt} {flag[1:]}: exit 0 and nothing changed: ignored"
            outcomes.append("applies")
        else:
            assert _refused_naming(r, name, opt), f"{opt}: not one line naming it: {r.output[-600:]!r} {r.exception!r}"
            outcomes.append("refused")
    return outcomes


def _run_flags(tmp: Path, serving_dir: Path) -> dict[str, tuple[list, list]]:
    prompts = tmp / "p.txt"
    prompts.write_text('{"prompt_ids": [1, 2]}\n')
    state = tmp / "state.safetensors"
    state.write_bytes(b"")
    sample = ["--temperature", "1"]
    return {
        "backend": (["--backend", "pt2"], []), "prompt": (["--prompt", "hi"], []),
        "prompt_ids": (["--prompt-ids", "4,5"], []), "chat": (["--chat"], ["--prompt", "hi"]),
        "max_new_tokens": (["--max-new-tokens", "3"], []), "temperature": (["--temperature", "0.5"], []),
        "top_k": (["--top-k", "5"], sample), "top_p": (["--top-p", "0.5"], sample), "seed": (["--seed", "3"], sample),
        "provider": (["--provider", "cpu"], []), "skip_hash_check": (["--skip-hash-check"], []),
        "cuda_graph": (["--cuda-graph"], []), "prompts": (["--prompts", prompts], []),
        "prompts_format": (["--prompts-format", "jsonl"], ["--prompts", prompts]),
        "max_sequences": (["--max-sequences", "2"], []), "cache_blocks": (["--cache-blocks", "64"], []),
        "max_step_tokens": (["--max-step-tokens", "64"], []), "json_out": (["--json", tmp / "o.json"], []),
        "save_state": (["--save-state", tmp / "s.safetensors"], []), "load_state": (["--load-state", state], []),
        "prefix_cache": (["--prefix-cache"], []), "prefix_cache_mb": (["--prefix-cache-mb", "5"], ["--prefix-cache"]),
        "speculate": (["--speculate", "ngram:2"], []), "draft": (["--draft", serving_dir], []),
        "speculate_tokens": (["--speculate-tokens", "2"], ["--draft", serving_dir]),
    }


@pytest.mark.parametrize("kind", ["batch", "serving"])
def test_every_run_flag_applies_or_is_refused(kind, export_dir, serving_dir, tmp_path, recorded):
    folder = export_dir if kind == "batch" else serving_dir
    flags = _run_flags(tmp_path, serving_dir)
    params = {p.name: p.opts[0] for p in COMMANDS["run"].params if p.name != "export_dir"}
    assert set(flags) == set(params), "walk every flag of run"
    seen = {name: _walk(["run", folder], name, params[name], flag, companion, recorded)
            for name, (flag, companion) in flags.items()}
    serving_only = {"prompts", "prompts_format", "max_sequences", "cache_blocks", "max_step_tokens", "json_out",
                    "prefix_cache", "prefix_cache_mb", "speculate", "draft", "speculate_tokens"}
    for name in serving_only:  # the cases, by name
        assert seen[name][-1] == ("refused" if kind == "batch" else "applies"), name
    assert seen["cuda_graph"] == ["applies" if kind == "batch" else "refused"]
    assert seen["seed"] == ["refused", "applies"] and seen["speculate_tokens"][0] == "refused"
    assert seen["prefix_cache_mb"][0] == "refused"  # without --prefix-cache


def test_run_refuses_flags_that_clash(serving_dir, export_dir, tmp_path, recorded):
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"prompt_ids": [1, 2]}\n')
    (tmp_path / "s").write_bytes(b"")
    for folder, args, opt in [
        (serving_dir, ["--prompts", prompts, "--prompt-ids", "1,2"], "--prompt-ids"),
        (serving_dir, ["--save-state", tmp_path / "t", "--load-state", tmp_path / "s"], "--load-state"),
        (export_dir, ["--save-state", tmp_path / "t", "--load-state", tmp_path / "s"], "--load-state"),
        (export_dir, ["--backend", "pt2", "--provider", "cpu"], "--provider"),
    ]:
        r, _ = _invoke(["run", folder, *args], recorded)
        assert _refused_naming(r, "", opt), r.output
        assert not recorded


def test_draft_on_a_batch_export_is_one_short_line(serving_dir, export_dir, recorded):
    from k3x.runtime.runners import RunnerOptions
    from k3x.runtime.serve_prompts import Speculation, make_drafter

    with pytest.raises(ValueError) as e:
        make_drafter(Speculation(None, export_dir, 2), "pt2", RunnerOptions(), 512)
    assert len(str(e.value)) < 200 and "--draft" in str(e.value) and "not a serving export" in str(e.value)
    r, _ = _invoke(["run", export_dir, "--draft", serving_dir], recorded)
    assert _refused_naming(r, "", "--draft"), r.output


VERIFY = {"backends": (["--backends", "pt2"], []), "steps": (["--steps", "2"], []),
          "prompt_len": (["--prompt-len", "3"], []), "batch": (["--batch", "2"], []), "seed": (["--seed", "5"], []),
          "provider": (["--provider", "cpu"], []), "skip_hash_check": (["--skip-hash-check"], []),
          "cuda_graph": (["--cuda-graph"], [])}


@pytest.mark.parametrize("kind", ["batch", "serving"])
def test_every_verify_flag_applies_or_is_refused(kind, export_dir, serving_dir, built, tmp_path, recorded):
    folder = export_dir if kind == "batch" else serving_dir
    flags = VERIFY | {"checkpoint": (["--checkpoint", built / "ckpt"], []),
                      "json_out": (["--json", tmp_path / "v"], [])}
    params = {p.name: p.opts[0] for p in COMMANDS["verify"].params if p.name != "export_dir"}
    assert set(flags) == set(params), "walk every flag of verify"
    seen = {name: _walk(["verify", folder], name, params[name], flag, companion, recorded)
            for name, (flag, companion) in flags.items()}
    assert seen["batch"] == seen["cuda_graph"] == ["applies" if kind == "batch" else "refused"]
    r, _ = _invoke(["verify", folder, "--backends", "pt2", "--provider", "cpu"], recorded)
    assert _refused_naming(r, "", "--provider"), r.output


INSPECT = {"json_out": (["--json"], []), "tp": (["--tp", "2"], []), "ep": (["--ep", "2"], []),
           "batch": (["--batch", "2"], ["--tp", "2"]), "context": (["--context", "1024"], ["--tp", "2"]),
           "sequences": (["--sequences", "2"], []), "dtype": (["--dtype", "bf16"], ["--sequences", "2"]),
           "chunk": (["--chunk", "8"], ["--sequences", "2"]), "export": (["--export", "."], [])}


@pytest.mark.parametrize("mode", [[], ["--sequences", "2"]])
def test_every_inspect_flag_applies_or_is_refused(mode, recorded):
    params = {p.name: p.opts[0] for p in COMMANDS["inspect"].params}
    assert set(INSPECT) | {"preset", "checkpoint"} == set(params), "walk every flag of inspect"
    base = ["inspect", "--preset", "k3-mini", *mode]
    seen = {name: _walk(base, name, params[name], flag, [] if mode else companion, recorded)
            for name, (flag, companion) in INSPECT.items() if name != "sequences" or not mode}
    assert seen["export"] == ["refused"]  # --export takes no other flag (here --preset)
    if mode:
        assert seen["json_out"] == seen["batch"] == ["refused"] and seen["chunk"] == ["applies"]
    else:
        assert seen["dtype"] == seen["chunk"] == seen["batch"] == seen["context"] == ["refused", "applies"]
