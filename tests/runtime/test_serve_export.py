"""Continuous batching on exported serving steps (`k3x export --serving`): pt2 and ONNX Runtime, fp32, CPU,
k3-mini. 12 prompts of lengths 1..300 with different max-new-tokens, more prompts than slots (admitted as
slots free up), long prompts prefilled in chunks: every sequence's greedy tokens equal its solo eager run,
its logits within the fp32 tolerance. Also the CLI (`k3x run --prompts --json`) and its one-line refusals."""

from __future__ import annotations

import json
import re

import pytest
import torch
from serving_cases import assert_records_match_solo, prompts, solo
from typer.testing import CliRunner

from k3x.cli import app
from k3x.exporter.options import ExportOptions, Target
from k3x.exporter.pipeline import export
from k3x.model import build_model, preset
from k3x.runtime.runners import RunnerError
from k3x.runtime.serve import ServeOptions, serve, serving_runner
from k3x.text.sampling import SamplingOptions

CFG = preset("k3-mini")
LENGTHS = [1, 300, 2, 17, 64, 5, 150, 33, 1, 9, 250, 3]
NEW = [5, 2, 7, 1, 3, 6, 2, 4, 8, 3, 1, 5]
cli = CliRunner()


@pytest.fixture(scope="module")
def model():
    return build_model(CFG, dtype=torch.float32, seed=0).eval()  # what export --preset k3-mini builds (seed 0)


@pytest.fixture(scope="module")
def folder(serving_export):
    return serving_export  # tests/conftest.py: shared with the prefix-cache tests


def test_manifest_names_the_interface(folder):
    m = json.loads((folder / "manifest.json").read_text())
    assert m["serving"]["block_size"] == 8
    assert m["io"]["inputs"][:6] == ["input_ids", "cu_seqlens", "past_lens", "slots", "block_table", "logits_index"]
    assert m["io"]["outputs"] == ["logits", "new.0.conv", "new.0.recurrent", "new.1.conv", "new.1.recurrent",
                                  "new.2.latent", "new.3.conv", "new.3.recurrent", "new.4.latent", "new.5.latent"]


@pytest.mark.parametrize("backend", ["pt2", "ort"])
def test_continuous_batching_equals_solo(folder, model, backend):
    ps = prompts(LENGTHS, CFG.vocab_size)
    opts = ServeOptions(max_sequences=4, block_size=8, max_step_tokens=96, keep_logits=True)
    records = serve(serving_runner(backend, folder), CFG, ps, SamplingOptions(), opts, max_new_tokens=NEW)
    assert_records_match_solo(model, records, ps, NEW, backend)


def test_cli_serves_a_prompt_file_in_input_order(folder, model, tmp_path):
    ps = prompts([3, 40, 1], CFG.vocab_size, seed=2)
    (tmp_path / "p.jsonl").write_text("".join(json.dumps({"prompt_ids": p}) + "\n" for p in ps))
    out = tmp_path / "out.json"
    r = cli.invoke(app, ["run", str(folder), "--backend", "ort", "--prompts", str(tmp_path / "p.jsonl"),
                         "--max-new-tokens", "4", "--max-sequences", "2", "--max-step-tokens", "16",
                         "--json", str(out)])
    assert r.exit_code == 0, r.output
    records = json.loads(out.read_text())
    assert [x["index"] for x in records] == [0, 1, 2]
    assert [x["tokens"] for x in records] == [solo(model, p, 4)[0] for p in ps]


def test_one_prompt_on_a_serving_export_runs_as_today(folder, model):
    r = cli.invoke(app, ["run", str(folder), "--backend", "pt2", "--prompt-ids", "4,5,6", "--max-new-tokens", "3"])
    assert r.exit_code == 0, r.output
    assert "[0] tokens: " + ",".join(map(str, solo(model, [4, 5, 6], 3)[0])) in r.output


def test_inspect_prints_the_pool_memory():
    r = cli.invoke(app, ["inspect", "--preset", "k3", "--context", "1048576", "--sequences", "2"])
    assert r.exit_code == 0, r.output
    assert "27,648 B per token" in r.output and "131,072 blocks" in r.output  # 2 x 1M / 16


def test_inspect_pools_in_the_export_dtype():
    r = cli.invoke(app, ["inspect", "--preset", "k3", "--context", "4096", "--sequences", "1", "--dtype", "fp32"])
    assert r.exit_code == 0, r.output
    assert "55,296 B per token" in r.output  # fp32 latents: twice the bf16 27,648 B


@pytest.mark.parametrize("text, flags, message", [
    ('{"prompt_ids": [1, 2]}\n\n{"prompt_ids": [3]}\n', [], "p.jsonl:2: empty line"),
    ('{"prompt_ids": [1, 2]}\n{"prompt": "hello"}\n', [], "p.jsonl:2: \"prompt\" is text, but the export has no "
                                                         "tokenizer"),
    ('{"prompt_ids": [1, 999]}\n', [], "p.jsonl:1: token ids must be in [0, 512)"),
    ('{"prompt_ids": [1]}\n', ["--cache-blocks", "1", "--max-new-tokens", "9"],
     "request 0: 9 positions need 2 blocks; the cache has 1"),
])
def test_cli_refuses_bad_input_in_one_line(folder, tmp_path, text, flags, message):
    (tmp_path / "p.jsonl").write_text(text)
    out = tmp_path / "out.json"
    r = cli.invoke(app, ["run", str(folder), "--backend", "pt2", "--prompts", str(tmp_path / "p.jsonl"),
                         "--json", str(out), *flags])
    assert r.exit_code == 1 and message in r.output and "Traceback" not in r.output
    assert not out.exists()


def test_prompts_on_a_batch_export_are_refused(tmp_path):
    out = tmp_path / "plain"
    export(ExportOptions((Target.PT2,), out, preset="k3-mini"))
    with pytest.raises(RunnerError, match="not a serving export"):
        serving_runner("pt2", out)


@pytest.mark.parametrize("backend, message", [
    ("trt", "no trt artifact (it has: onnx, pt2); make it with `k3x build-engine"),  # the serving engine's runner
    ("aoti", "no aoti artifact (it has: onnx, pt2)"),
])
def test_serving_backends_without_their_artifact_say_so(folder, backend, message):
    with pytest.raises(RunnerError, match=re.escape(message)):
        serving_runner(backend, folder)


def test_serving_export_from_a_checkpoint_streams_its_weights(mini_cli_export, tmp_path):
    """From a checkpoint the weights are streamed into the step program, named as the step names them (the
    model is its `lm` child); text prompts go through the checkpoint's tokenizer. Tokens equal the solo
    eager run of the checkpoint (the README's serving lines)."""
    from k3x.checkpoint.files import load_checkpoint

    out = tmp_path / "serve"
    r = cli.invoke(app, ["export", "--checkpoint", str(mini_cli_export.checkpoint), "--out", str(out), "--serving",
                         "--target", "pt2", "--target", "onnx"])
    assert r.exit_code == 0, r.output
    (tmp_path / "p.jsonl").write_text('{"prompt_ids": [1, 2, 3]}\n{"prompt": "Hello there"}\n')
    model = load_checkpoint(mini_cli_export.checkpoint, dtype=torch.float32).eval()
    want = [solo(model, [1, 2, 3], 4)[0]]
    for backend in ("pt2", "ort"):
        r = cli.invoke(app, ["run", str(out), "--backend", backend, "--prompts", str(tmp_path / "p.jsonl"),
                             "--max-new-tokens", "4", "--json", str(tmp_path / f"{backend}.json")])
        assert r.exit_code == 0, r.output
        records = json.loads((tmp_path / f"{backend}.json").read_text())
        assert [rec["index"] for rec in records] == [0, 1] and "text" in records[1]
        assert records[0]["tokens"] == want[0], backend
