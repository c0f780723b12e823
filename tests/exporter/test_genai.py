"""ONNX Runtime GenAI drives a k3x export: `og.Model(export)` + `og.Generator` give the same greedy tokens as
`k3x run --backend ort`, over a prompt longer than one KDA chunk (64) and >= 32 new tokens; its tokenizer
reads the copied tokenizer files; weights in external data work too. Runs on CPU (providers cleared)."""

from __future__ import annotations

import json

import onnx_ir as ir
import pytest
import torch
from typer.testing import CliRunner

from k3x.cli import app
from k3x.exporter.genai import GENAI_CONFIG, GENAI_MODEL, genai_stage, half_latent
from k3x.exporter.onnx import OnnxOptions, onnx_stage
from k3x.exporter.trace import op_counts
from k3x.folder.artifacts import ExportFolder, init_manifest
from k3x.model import preset
from k3x.runtime.runners import RunnerOptions, generate, make_runner
from k3x.text.sampling import SamplingOptions
from k3x.text.tokenizer import find_tokenizer
from onnx_mini_folder import mini_export

og = pytest.importorskip("onnxruntime_genai")
cli = CliRunner()
NEW = 32
PROMPT = [int(x) for x in torch.randint(4, 500, (70,), generator=torch.Generator().manual_seed(3))]


@pytest.fixture(scope="module")
def export_dir(mini_cli_export):
    """The session's CLI export of k3-mini (tests/conftest.py): read only here."""
    out, printed = mini_cli_export.export, mini_cli_export.output
    # every path printed is the final one, never the staging folder the export was built in
    assert f"genai: {out / 'genai_config.json'}" in printed and "k3x-tmp" not in printed, printed
    return out


def og_greedy(folder, prompt: list[int], new: int) -> list[int]:
    config = og.Config(str(folder))
    config.clear_providers()  # CPU, whatever the machine has
    model = og.Model(config)
    params = og.GeneratorParams(model)
    params.set_search_options(max_length=len(prompt) + new, do_sample=False)
    gen = og.Generator(model, params)
    gen.append_tokens(prompt)
    out = []
    while not gen.is_done():
        gen.generate_next_token()
        out.append(int(gen.get_next_tokens()[0]))
    return out


def test_genai_tokens_equal_k3x_run_ort(export_dir):
    assert (export_dir / GENAI_MODEL).is_file() and "genai" in ExportFolder.open(export_dir).manifest["artifacts"]
    r = cli.invoke(app, ["run", str(export_dir), "--backend", "ort", "--provider", "cpu", "--max-new-tokens",
                         str(NEW), "--prompt-ids", ",".join(map(str, PROMPT))])
    assert r.exit_code == 0, r.output
    ours = [int(t) for t in r.output.split("tokens: ")[1].split()[0].split(",")]
    assert len(ours) == NEW  # no EOS on the way: the comparison covers every step
    assert og_greedy(export_dir, PROMPT, NEW) == ours


def test_genai_config_and_tokenizer(export_dir):
    cfg = json.loads((export_dir / GENAI_CONFIG).read_text())
    tok = find_tokenizer(export_dir)
    assert cfg["model"]["eos_token_id"] == tok.eos_token_ids[0]
    assert cfg["model"]["decoder"]["head_size"] == half_latent(preset("k3-mini"))  # latent, halved: 16 + 16
    config = og.Config(str(export_dir))
    config.clear_providers()
    text = "Hello! How are you today?"
    assert list(og.Tokenizer(og.Model(config)).encode(text)) == tok.encode(text)


@pytest.mark.slow
def test_genai_model_with_external_data(tmp_path):
    m = mini_export()
    cfg = preset("k3-mini")
    init_manifest(tmp_path, cfg, dtype=torch.float32, weights=True, op_counts=op_counts(m.ep))
    art = onnx_stage(tmp_path, m.ep, cfg, OnnxOptions(flavors=("ort",), external_data=True))
    assert "skipped — no EOS id" in genai_stage(tmp_path, cfg, art.files["ort"].name)
    assert not (tmp_path / GENAI_MODEL).exists()
    prompt = torch.tensor([PROMPT[:10]])
    ours = generate(make_runner("ort", tmp_path, RunnerOptions(provider="cpu")), cfg, prompt,
                    SamplingOptions(max_new_tokens=8)).tokens[0].tolist()
    eos = max(set(range(cfg.vocab_size)) - set(ours))  # an EOS the greedy run never emits: GenAI runs all 8
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": eos}))
    genai_stage(tmp_path, cfg, art.files["ort"].name)
    wrapped = ir.load(tmp_path / GENAI_MODEL)
    assert any(isinstance(v.const_value, ir.ExternalTensor) for v in wrapped.graph.initializers.values())
    assert (tmp_path / GENAI_MODEL).stat().st_size < 1_000_000  # weights referenced, not copied
    assert og_greedy(tmp_path, PROMPT[:10], 8) == ours


def test_odd_latent_width_is_refused():
    import dataclasses

    cfg = preset("k3-mini")
    odd = dataclasses.replace(cfg, mla=dataclasses.replace(cfg.mla, qk_rope_head_dim=7))
    with pytest.raises(ValueError, match="latent width 31"):
        half_latent(odd)


def test_static_cache_gets_no_genai_package_and_the_reason(tmp_path):
    """A static latent cache (past_length input) has no GenAI mapping here: skipped with one line, and the
    wrapper refuses a graph with a past_length input rather than write a package GenAI would feed wrongly."""
    import onnx_ir as ir
    import pytest

    from k3x.exporter import genai
    from k3x.model import preset
    from k3x.model.options import CacheOptions

    note = genai.genai_stage(tmp_path, preset("k3-mini"), "model.onnx", cache=CacheOptions(64))
    assert note == genai.STATIC_CACHE_NOTE and "\n" not in note and not list(tmp_path.iterdir())
    graph = ir.Graph([ir.Value(name="input_ids"), ir.Value(name="past_length")], [], nodes=[])
    with pytest.raises(ValueError, match="^a static latent cache .--max-context. has a past_length input"):
        genai.wrap_for_genai(ir.Model(graph, ir_version=10), preset("k3-mini"))
