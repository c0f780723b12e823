"""The CLI of the model stage: init-checkpoint, inspect, generate, logits (typer CliRunner)."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from typer.testing import CliRunner

from k3x.checkpoint.files import load_checkpoint
from k3x.cli import app
from k3x.console import printable
from k3x.runtime.generate import full_logits, generate
from k3x.text.sampling import SamplingOptions
from k3x.text.tokenizer import find_tokenizer

runner = CliRunner()


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    path = tmp_path_factory.mktemp("cli") / "ckpt"
    r = runner.invoke(app, ["init-checkpoint", "--preset", "k3-mini", "--out", str(path), "--seed", "7"])
    assert r.exit_code == 0, r.output
    return path


def test_help_lists_commands():
    r = runner.invoke(app, ["--help"])
    assert r.exit_code == 0
    for cmd in ("init-checkpoint", "inspect", "generate", "logits"):
        assert cmd in r.output


def test_inspect_k3_figures():
    r = runner.invoke(app, ["inspect", "--preset", "k3", "--json"])
    assert r.exit_code == 0, r.output
    s = json.loads(r.output)
    assert round(s["total_params"] / 1e9, 1) == 2779.5
    assert round(s["active_params_excluding_embedding"] / 1e9, 1) == 104.2
    assert (s["num_layers"], s["kda_layers"], s["mla_layers"], s["moe_layers"]) == (93, 69, 24, 92)
    assert s["mla_kv_bytes_per_token"] == 24 * 576 * 2


def test_inspect_kimi_linear_and_text():
    r = runner.invoke(app, ["inspect", "--preset", "kimi-linear-48b", "--json"])
    s = json.loads(r.output)
    assert round(s["total_params"] / 1e9, 1) == 49.1 and round(s["active_params_excluding_embedding"] / 1e9, 1) == 3.1
    r = runner.invoke(app, ["inspect", "--preset", "k3-mini"])
    assert r.exit_code == 0 and "KDA" in r.output and "params total" in r.output


def test_inspect_checkpoint_and_errors(ckpt, tmp_path):
    assert runner.invoke(app, ["inspect", "--checkpoint", str(ckpt)]).exit_code == 0
    r = runner.invoke(app, ["inspect", "--preset", "k4"])
    assert r.exit_code == 1 and "k3-mini" in r.output
    r = runner.invoke(app, ["inspect"])
    assert r.exit_code == 1 and "exactly one" in r.output


def _tokens(output: str) -> list[int]:
    return [int(t) for t in output.split("tokens: ")[1].split()[0].split(",")]


def _library(ckpt, ids: list[int], **kwargs) -> list[int]:
    eos = find_tokenizer(ckpt).eos_token_ids  # init-checkpoint wrote a tokenizer: EOS stops the CLI
    opts = SamplingOptions(eos_token_ids=eos, **kwargs)
    return generate(load_checkpoint(ckpt), torch.tensor([ids]), opts).tokens[0].tolist()


def test_generate_matches_library(ckpt):
    r = runner.invoke(app, ["generate", "--checkpoint", str(ckpt), "--prompt-ids", "1,2,3", "--max-new-tokens", "5"])
    assert r.exit_code == 0, r.output
    assert _tokens(r.output) == _library(ckpt, [1, 2, 3], max_new_tokens=5) and "tokens/s" in r.output


def test_generate_sampling_flags(ckpt):
    def tokens(*flags: str) -> list[int]:
        r = runner.invoke(app, ["generate", "--checkpoint", str(ckpt), "--prompt-ids", "1,2,3", "--max-new-tokens",
                                "8", *flags])
        assert r.exit_code == 0, r.output
        return _tokens(r.output)

    sampled = tokens("--temperature", "1.5", "--top-p", "0.9", "--seed", "4")
    assert sampled == tokens("--temperature", "1.5", "--top-p", "0.9", "--seed", "4")
    assert sampled == _library(ckpt, [1, 2, 3], max_new_tokens=8, temperature=1.5, top_p=0.9, seed=4)
    r = runner.invoke(app, ["generate", "--checkpoint", str(ckpt), "--top-k", "5"])
    assert r.exit_code == 1 and "give temperature > 0" in r.output
    r = runner.invoke(app, ["generate", "--checkpoint", str(ckpt), "--seed", "4"])  # greedy: a seed would do nothing
    assert r.exit_code == 1 and "--seed applies only when sampling" in r.output, r.output


def test_generate_text_in_and_out(ckpt):
    tok = find_tokenizer(ckpt)
    r = runner.invoke(app, ["generate", "--checkpoint", str(ckpt), "--prompt", "Hello! How are", "--max-new-tokens",
                            "6"])
    assert r.exit_code == 0, r.output
    tokens = _tokens(r.output)
    assert tokens == _library(ckpt, tok.encode("Hello! How are"), max_new_tokens=6)
    # streamed text (escaped; no special tokens; a character still incomplete at the end is not shown), then the ids
    assert r.output.startswith(printable(tok.decode(tokens, skip_special=True).rstrip("\ufffd")) + "\n")
    r = runner.invoke(app, ["generate", "--checkpoint", str(ckpt), "--prompt", "Hi", "--chat", "--max-new-tokens", "3"])
    assert r.exit_code == 0, r.output
    assert _tokens(r.output) == _library(ckpt, tok.encode(tok.chat_prompt("Hi")), max_new_tokens=3)


@pytest.mark.parametrize("args,message", [
    (["--prompt", "a", "--prompt-ids", "1"], "not both"),
    (["--chat"], "--chat applies the chat template to --prompt"),
])
def test_prompt_flag_errors(ckpt, args, message):
    r = runner.invoke(app, ["generate", "--checkpoint", str(ckpt), *args])
    assert r.exit_code == 1 and message in r.output, r.output


def test_text_prompt_without_a_tokenizer_is_named(tmp_path):
    path = tmp_path / "bare"
    r = runner.invoke(app, ["init-checkpoint", "--out", str(path), "--no-tokenizer"])
    assert r.exit_code == 0 and not (path / "tokenizer.json").exists()
    r = runner.invoke(app, ["generate", "--checkpoint", str(path), "--prompt", "Hello"])
    assert r.exit_code == 1 and "no tokenizer" in r.output and "--prompt-ids" in r.output


def test_logits_file_and_batch(ckpt, tmp_path):
    out = tmp_path / "l.npy"
    r = runner.invoke(app, ["logits", "--checkpoint", str(ckpt), "--input-ids", "4,5,6", "--out", str(out)])
    assert r.exit_code == 0, r.output
    got = np.load(out)
    assert got.shape == (1, 3, 512) and got.dtype == np.float32
    expect = full_logits(load_checkpoint(ckpt), torch.tensor([[4, 5, 6]])).numpy()
    np.testing.assert_allclose(got, expect, rtol=1e-6, atol=1e-6)
    ids = tmp_path / "ids.npy"
    np.save(ids, np.array([[1, 2], [3, 4]]))
    r = runner.invoke(app, ["logits", "--checkpoint", str(ckpt), "--batch-file", str(ids), "--out", str(out)])
    assert r.exit_code == 0 and np.load(out).shape == (2, 2, 512)


@pytest.mark.parametrize("args,message", [
    (["--input-ids", "1,x"], "expected comma-separated integers"),
    (["--input-ids", "1,99999"], "token ids must be in"),
])
def test_logits_bad_input(ckpt, tmp_path, args, message):
    r = runner.invoke(app, ["logits", "--checkpoint", str(ckpt), "--out", str(tmp_path / "o.npy"), *args])
    assert r.exit_code == 1 and message in r.output


def test_bad_checkpoint_is_one_clear_error(tmp_path):
    r = runner.invoke(app, ["generate", "--checkpoint", str(tmp_path)])
    assert r.exit_code == 1 and "no config.json" in r.output


@pytest.mark.parametrize("args,message", [
    (["generate", "--prompt-ids", "1,99999"], "token ids must be in"),
    (["logits", "--batch-file", "/nonexistent/ids.npy", "--out", "/tmp/k3x-l.npy"], "does not exist"),
    (["logits", "--input-ids", "1,2", "--out", "/nonexistent/dir/l.npy"], "the folder /nonexistent/dir does not exist"),
])
def test_bad_paths_and_ids_are_clear_errors(ckpt, args, message):
    r = runner.invoke(app, [args[0], "--checkpoint", str(ckpt), *args[1:]])
    assert r.exit_code == 1 and message in r.output, r.output
