"""`k3x export` (typer CliRunner): stages with progress, manifest, --no-weights, --checkpoint, and clear
failures — bad options and configs fail before tracing and write nothing; a failing stage leaves nothing
half-written."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from typer.testing import CliRunner

from k3x.cli import app
from k3x.exporter.options import TARGET_STAGES, Target
from k3x.exporter.trace import load_pt2
from k3x.folder.artifacts import ExportFolder
from k3x.model import PRESETS, build_model, preset

runner = CliRunner()
MINI_OPS = {"k3::attn_res": 12, "k3::kda": 3, "k3::moe": 5}


def export(*args: str):
    return runner.invoke(app, ["export", *args])


def test_every_target_has_stages():
    assert set(TARGET_STAGES) == set(Target)


def test_export_pt2_with_progress_and_manifest(tmp_path):
    out = tmp_path / "out"
    r = export("--preset", "k3-mini", "--target", "pt2", "--out", str(out), "--seed", "3", "--dtype", "bf16")
    assert r.exit_code == 0, r.output
    for stage in ("config", "model", "trace", "manifest", "pt2"):
        assert f"[{stage}] done in" in r.output
    m = ExportFolder.open(out)
    assert m.manifest["op_counts"] == MINI_OPS and m.manifest["weights"] is True and m.dtype() is torch.bfloat16
    assert m.manifest["artifacts"]["pt2"]["files"][0]["path"] == "model.pt2" and m.verify() == []
    ep = load_pt2(m.artifact("pt2"))
    want = build_model(preset("k3-mini"), seed=3, dtype=torch.bfloat16).state_dict()["lm_head.weight"]
    assert torch.equal(ep.state_dict["lm_head.weight"], want)  # --seed reached the weights


def test_export_no_weights_traces_on_meta_and_runs_once_weights_are_attached(tmp_path):
    from test_trace import check_prefill_decode

    from k3x.exporter.trace import with_weights
    from k3x.model import empty_state

    out = tmp_path / "out"
    r = export("--preset", "k3-mini", "--no-weights", "--out", str(out))
    assert r.exit_code == 0, r.output
    assert "weightless" in r.output
    m = ExportFolder.open(out).manifest
    assert m["weights"] is False and m["checkpoint"] is None and m["artifacts"]["pt2"]["weights"] is False
    ep = load_pt2(out / "model.pt2")
    assert {t.device.type for t in ep.state_dict.values()} == {"meta"}
    model = build_model(preset("k3-mini"), seed=0)
    module = with_weights(ep, model.state_dict()).module()  # weights by name, no re-trace
    ids, step, past = torch.randint(0, 512, (2, 5)), torch.randint(0, 512, (2, 1)), empty_state(model.cfg, 2)
    logits, present = module(ids, past)
    logits2, present2 = module(step, present)
    check_prefill_decode(model, ids, step, past, logits, present, logits2, present2, what="weightless pt2")


def test_export_from_checkpoint_records_its_hash_and_copies_its_tokenizer(tmp_path):
    from k3x.checkpoint.save import save_checkpoint
    from k3x.checkpoint.reference import checkpoint_hash
    from k3x.text.tiny_tokenizer import tokenizer_files
    from k3x.text.tokenizer import find_tokenizer

    ckpt = tmp_path / "ckpt"
    save_checkpoint(build_model(preset("k3-mini"), seed=1), ckpt, expert_format="dense",
                    extra_files=tokenizer_files(512))
    r = export("--checkpoint", str(ckpt), "--out", str(tmp_path / "out"))
    assert r.exit_code == 0, r.output
    d = ExportFolder.open(tmp_path / "out")
    assert d.manifest["checkpoint"] == {"path": str(ckpt.resolve()), "hash": checkpoint_hash(ckpt)}
    assert d.config() == preset("k3-mini") and d.checkpoint() == ckpt.resolve()
    copied = sorted(f.name for f in d.files("tokenizer"))
    assert copied == ["generation_config.json", "tokenizer.json", "tokenizer_config.json"]
    assert all((d.path / n).read_bytes() == (ckpt / n).read_bytes() for n in copied)
    r = CliRunner().invoke(app, ["run", str(tmp_path / "out"), "--backend", "pt2", "--prompt", "Hello",
                                 "--max-new-tokens", "4"])
    assert r.exit_code == 0, r.output
    ids = [int(t) for t in r.output.split("tokens: ")[1].split()[0].split(",")]
    # the text was printed (no special tokens, no character left incomplete at the end)
    assert find_tokenizer(ckpt).decode(ids, skip_special=True).rstrip("\ufffd") in r.output


@pytest.mark.parametrize("args,needle", [
    pytest.param(["--preset", "k3-mini", "--checkpoint", "."], "exactly one", id="both-sources"),
    pytest.param([], "exactly one", id="no-source"),
    pytest.param(["--preset", "k3-tiny"], "preset='k3-tiny'", id="unknown-preset"),
    pytest.param(["--preset", "k3-mini", "--target", "aoti", "--no-weights"], "--no-weights", id="aoti-needs-weights"),
    pytest.param(["--checkpoint", "/nonexistent/ckpt"], "/nonexistent/ckpt", id="missing-checkpoint"),
    pytest.param(["--preset", "k3"], "--no-weights", id="k3-weights-do-not-fit"),  # 2.78 T parameters
])
def test_bad_options_fail_before_writing(tmp_path, args, needle):
    out = tmp_path / "out"
    r = export(*args, "--out", str(out))
    assert r.exit_code == 1
    assert needle in r.output
    assert "[trace]" not in r.output and not out.exists()


def _unsupported_kda_head_dim() -> "K3Config":  # noqa: F821
    """k3-mini with kda.head_dim = 512, bypassing K3Config's own validation (as a hand-built config could)."""
    cfg = preset("k3-mini")
    kda = dataclasses.replace(cfg.kda)
    object.__setattr__(kda, "head_dim", 512)
    bad = dataclasses.replace(cfg, name="k3-bad-kda")
    object.__setattr__(bad, "kda", kda)
    return bad


def test_op_limits_name_the_field():
    from k3x.custom_ops.registry import check_config

    assert check_config(preset("k3"), kernels=True) is None
    assert check_config(_unsupported_kda_head_dim(), kernels=False).startswith("kda.head_dim=512")


def test_config_the_ops_cannot_handle_fails_before_tracing(tmp_path, monkeypatch):
    monkeypatch.setitem(PRESETS, "k3-bad-kda", _unsupported_kda_head_dim())
    r = export("--preset", "k3-bad-kda", "--no-weights", "--out", str(tmp_path / "out"))
    assert r.exit_code == 1 and "kda.head_dim=512" in r.output
    assert "[model]" not in r.output and not (tmp_path / "out").exists()


def tiny_ep():
    return torch.export.export(torch.nn.Linear(4, 4), (torch.zeros(2, 4),))


def test_failing_stage_leaves_nothing_half_written(tmp_path, monkeypatch):
    import k3x.exporter.trace as trace_mod

    def broken_save(ep, path, **_):  # save_pt2's keywords (the save function to use)
        path.write_bytes(b"half a program")
        raise RuntimeError("injected: disk full")

    monkeypatch.setattr(trace_mod, "save_pt2", broken_save)
    monkeypatch.setattr(trace_mod, "trace", lambda model, **kw: tiny_ep())  # the failure is in the stage, not the trace
    out = tmp_path / "out"
    r = export("--preset", "k3-mini", "--no-weights", "--out", str(out))
    assert r.exit_code == 1 and "export to" in r.output and "RuntimeError: injected: disk full" in r.output
    assert not out.exists() and sorted(p.name for p in tmp_path.iterdir()) == []  # the whole export or nothing
