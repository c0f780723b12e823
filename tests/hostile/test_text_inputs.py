"""Hostile checkpoint text files and decode flags: transformers-style configs of the wrong types, malformed or
non-UTF-8 tokenizer / tiktoken / tokenizer_config / generation_config files, chat templates that fail, loop
forever or grow without bound, and sampling flags out of range. Each is one `error:` line, exit 1 (the
commands fail before the model is loaded, so each case takes about a second)."""

from __future__ import annotations

import base64
import json
from pathlib import Path

import pytest
from hostile_util import k3x


def _config(change):
    def edit(d: Path) -> None:
        c = json.loads((d / "config.json").read_text())
        text = c["text_config"]
        change(text, text["num_hidden_layers"])
        (d / "config.json").write_text(json.dumps(c))
    return edit


def _transformers_style(extra):
    def change(t, n):
        t.update(layer_types=["linear_attention"] * (n - 1) + ["full_attention"], linear_num_heads=2,
                 linear_head_dim=8)
        extra(t, n)
    return _config(change)


def _write(name: str, data: str | bytes):
    def edit(d: Path) -> None:
        (d / name).write_bytes(data if isinstance(data, bytes) else data.encode())
    return edit


def _tiktoken(extra: str | bytes = "", config: dict | None = None, bytes_from: int = 0):
    """A tiktoken model (every single byte ranked, from `bytes_from`) with `extra` appended, replacing
    tokenizer.json; `config` as tokenizer_config.json."""
    def edit(d: Path) -> None:
        lines = "".join(f"{base64.b64encode(bytes([b])).decode()} {b}\n" for b in range(bytes_from, 256))
        (d / "tokenizer.json").unlink()
        (d / "tiktoken.model").write_bytes(lines.encode() + (extra if isinstance(extra, bytes) else extra.encode()))
        if config is not None:
            (d / "tokenizer_config.json").write_text(json.dumps(config))
    return edit


def _one_error_line(code: int, out: str, expected: str) -> None:
    lines = out.strip().splitlines()
    assert code == 1 and len(lines) == 1 and lines[0].startswith("error: ") and expected in lines[0], out[-800:]


CONFIGS = [  # (case, edit of the checkpoint, text the one line holds)
    ("mlp_layer_types of lists", _config(lambda t, n: t.update(mlp_layer_types=[[1]] * n)), "mlp_layer_types has [[1]]"),
    ("layer_types of objects", _transformers_style(lambda t, n: t.update(layer_types=[{}] * n)), "layer_types has [{}]"),
    ("linear_attn_config a list", _transformers_style(lambda t, n: t.update(linear_attn_config=[1])),
     "linear_attn_config=[1]: must be a dict"),
    ("kda_layers mixed types", _transformers_style(lambda t, n: t.update(
        linear_attn_config={**t["linear_attn_config"], "kda_layers": [1, "x"]})), "kda_layers=[1, 'x']"),
]


@pytest.mark.parametrize("case,edit,expected", CONFIGS, ids=[c[0] for c in CONFIGS])
def test_config_of_wrong_types_is_one_line_naming_the_field(ckpt_dir, case, edit, expected):
    edit(ckpt_dir)
    _one_error_line(*k3x("inspect", "--checkpoint", ckpt_dir), expected)


TOKENIZER_FILES = [
    ("generation_config not UTF-8", _write("generation_config.json", b"\xff\xfe{}"),
     "generation_config.json: not UTF-8"),
    ("eos id a string", _write("generation_config.json", '{"eos_token_id": "x"}'), "eos_token_id: 'x'"),
    ("eos id an object", _write("generation_config.json", '{"eos_token_id": {"a": 1}}'), "eos_token_id: {'a': 1}"),
    ("eos id infinite", _write("generation_config.json", '{"eos_token_id": 1e400}'), "eos_token_id: inf"),
    ("eos id fractional", _write("generation_config.json", '{"eos_token_id": [2, 1.5]}'), "eos_token_id: 1.5"),
    ("tokenizer_config not UTF-8", _write("tokenizer_config.json", b"\xff{}"), "tokenizer_config.json: not UTF-8"),
    ("tiktoken not UTF-8", _tiktoken(b"\xff\xfe 300\n"), "tiktoken.model: not UTF-8"),
    ("tiktoken rank past 2**32", _tiktoken("YWE= 100000000000000000000000\n"), "line 257: 1000"),
    ("tiktoken negative rank", _tiktoken("YWE= -5\n"), "line 257: -5"),
    ("tiktoken empty", _tiktoken(bytes_from=256), "256 of the 256 single bytes have no rank"),
    ("tiktoken rank twice", _tiktoken("YWE= 7\n"), "a rank is given to two tokens"),
    ("tiktoken missing bytes", _tiktoken(bytes_from=1), "1 of the 256 single bytes have no rank"),
    ("added token id not a number", _tiktoken(config={"added_tokens_decoder": {"x": {"content": "<s>"}}}),
     "added_tokens_decoder: 'x'"),
    ("added token not an object", _tiktoken(config={"added_tokens_decoder": {"300": "<s>"}}),
     "added_tokens_decoder['300'] has no \"content\" string"),
    ("added tokens a list", _tiktoken(config={"added_tokens_decoder": [1]}), "added_tokens_decoder must be an object"),
    ("two added tokens one id", _tiktoken(config={"added_tokens_decoder": {"300": {"content": "<a>"},
                                                                           "0300": {"content": "<b>"}}}),
     "two tokens one id"),
]


@pytest.mark.parametrize("case,edit,expected", TOKENIZER_FILES, ids=[c[0] for c in TOKENIZER_FILES])
def test_malformed_tokenizer_file_is_one_line_naming_it(ckpt_dir, case, edit, expected):
    edit(ckpt_dir)
    _one_error_line(*k3x("generate", "--checkpoint", ckpt_dir, "--prompt", "hi", "--max-new-tokens", "1"), expected)


TEMPLATES = [
    ("not UTF-8", b"\xff\xfe", "chat_template.jinja: not UTF-8"),
    ("type error", "{{ 1 + 'a' }}", "TypeError: unsupported operand"),
    ("division by zero", "{{ 1 / 0 }}", "ZeroDivisionError"),
    ("endless recursion", "{% macro f(n) %}{{ f(n) }}{% endmacro %}{{ f(1) }}", "recursion too deep"),
    ("range too big", "{{ range(10**9)|list }}", "range() of 1,000,000,000 items"),
    ("nested loops", "{% for i in range(9999) %}{% for j in range(9999) %}{% endfor %}{% endfor %}",
     "loop iterations and calls"),
    ("output too long", "{% for i in range(2000) %}{{ 'a' * 1000 }}{% endfor %}", "renders more than"),
    ("a 10 GB string", "{{ 'a' * 10**10 }}", "MiB of memory"),
    ("doubling a string", "{% set ns = namespace(s='a') %}{% for i in range(60) %}{% set ns.s = ns.s ~ ns.s %}"
                          "{% endfor %}{{ ns.s }}", "MiB of memory"),
    ("source too big", "x" * (2 << 20), "a chat template is at most"),
]


@pytest.mark.parametrize("case,template,expected", TEMPLATES, ids=[c[0] for c in TEMPLATES])
def test_hostile_chat_template_is_one_line(ckpt_dir, case, template, expected):
    _write("chat_template.jinja", template)(ckpt_dir)
    _one_error_line(*k3x("generate", "--checkpoint", ckpt_dir, "--prompt", "hi", "--chat", "--max-new-tokens", "1"),
                    expected)


def test_a_well_behaved_template_still_renders(ckpt_dir):
    _write("chat_template.jinja", "{% for m in messages %}<{{ m.role }}>{{ m.content }}{% endfor %}<assistant>")(
        ckpt_dir)
    code, out = k3x("generate", "--checkpoint", ckpt_dir, "--prompt", "hi", "--chat", "--max-new-tokens", "1")
    assert code == 0 and "tokens: " in out, out[-800:]


SAMPLING = [
    (["--temperature", "inf"], "temperature=inf: must be a finite number"),
    (["--temperature", "nan"], "temperature=nan"),
    (["--temperature", "-1"], "temperature=-1.0"),
    (["--temperature", "1", "--seed", str(1 << 70)], "seed=1180591620717411303424: must fit in 64 bits"),
]


@pytest.mark.parametrize("flags,expected", SAMPLING, ids=[" ".join(f[0]) for f in SAMPLING])
def test_sampling_flags_out_of_range_are_one_line(ckpt_dir, flags, expected):
    _one_error_line(*k3x("generate", "--checkpoint", ckpt_dir, "--max-new-tokens", "1", *flags), expected)


def test_a_tiny_temperature_samples_the_top_token(ckpt_dir):
    outs = [k3x("generate", "--checkpoint", ckpt_dir, "--max-new-tokens", "3", *flags)
            for flags in ([], ["--temperature", "1e-300", "--seed", "1"])]
    tokens = [[line for line in out.splitlines() if line.startswith("tokens: ")] for _, out in outs]
    assert [code for code, _ in outs] == [0, 0] and tokens[0] == tokens[1] and tokens[0], outs


def test_a_token_that_decodes_to_a_terminal_escape_is_printed_escaped(ckpt_dir, capsys):
    import torch

    from k3x.console import Printer
    from k3x.text.tokenizer import find_tokenizer

    _tiktoken("G1sySg== 256\n")(ckpt_dir)  # token 256 = ESC [ 2 J (clear the screen)
    printer = Printer(find_tokenizer(ckpt_dir))
    printer(torch.tensor([256]))
    printer.stream.flush()
    out = capsys.readouterr().out
    assert out == "\\x1b[2J", repr(out)
