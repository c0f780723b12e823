"""Tokenizers found in a folder: the init-time tiny BPE, a Kimi-style tiktoken model, EOS ids, chat template,
streaming, and clear errors."""

from __future__ import annotations

import base64
import json

import pytest

from k3x.text.tiny_tokenizer import MAX_VOCAB, tokenizer_files
from k3x.text.tokenizer import TokenizerError, eos_token_ids, find_tokenizer

TEXT = "Hello! The model reads a prompt: 42 tokens, ünïcödé, 日本語 ✓"


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    folder = tmp_path_factory.mktemp("tok")
    for name, data in tokenizer_files(512).items():
        (folder / name).write_bytes(data)
    return folder


def test_tiny_tokenizer_is_deterministic_and_fits_the_vocab(tiny):
    assert tokenizer_files(512) == {p.name: p.read_bytes() for p in tiny.iterdir()}
    tok = find_tokenizer(tiny)
    assert tok.backend.tok.get_vocab_size() <= MAX_VOCAB
    with pytest.raises(ValueError, match="vocab_size=100"):
        tokenizer_files(100)


def test_round_trip_stream_and_eos(tiny):
    tok = find_tokenizer(tiny)
    ids = tok.encode(TEXT)
    assert tok.decode(ids) == TEXT and max(ids) < 512
    assert len(ids) < len(TEXT.encode())  # the merges do something
    stream = tok.stream()
    pieces = [stream.push(i) for i in ids]
    assert "".join(pieces) + stream.flush() == TEXT
    assert "" in pieces  # a multi-byte character waited for its last byte
    assert tok.eos_token_ids == (tok.backend.token_id("<|eos|>"),)


def test_chat_template_renders_one_user_turn(tiny):
    tok = find_tokenizer(tiny)
    assert tok.chat_prompt("hi") == "<|bos|><|user|>hi<|eos|><|assistant|>"
    ids = tok.encode(tok.chat_prompt("hi"))
    assert ids[0] == tok.backend.token_id("<|bos|>") and ids[-1] == tok.backend.token_id("<|assistant|>")


def test_chat_without_a_template_is_named(tmp_path, tiny):
    (tmp_path / "tokenizer.json").write_bytes((tiny / "tokenizer.json").read_bytes())
    tok = find_tokenizer(tmp_path)
    assert tok.eos_token_ids == ()
    with pytest.raises(TokenizerError, match="--chat needs a chat template"):
        tok.chat_prompt("hi")


def test_eos_order_generation_config_then_config_then_tokenizer(tmp_path):
    assert eos_token_ids(tmp_path) == ()
    (tmp_path / "config.json").write_text(json.dumps({"text_config": {"eos_token_id": [5, 6]}}))
    assert eos_token_ids(tmp_path) == (5, 6)
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": 9}))
    assert eos_token_ids(tmp_path) == (9,)


def test_no_tokenizer_and_a_broken_one(tmp_path):
    assert find_tokenizer(tmp_path) is None
    (tmp_path / "tokenizer.json").write_text("{not json")
    with pytest.raises(TokenizerError, match="tokenizer.json: not a readable tokenizer.json"):
        find_tokenizer(tmp_path)


def test_kimi_tiktoken_model_with_special_tokens(tmp_path):
    pytest.importorskip("tiktoken")
    ranks = [bytes([b]) for b in range(256)] + [b"he", b"ll", b"hell", b"hello", b" w", b"or"]
    (tmp_path / "tiktoken.model").write_text(
        "".join(f"{base64.b64encode(t).decode()} {r}\n" for r, t in enumerate(ranks)))
    n = len(ranks)
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({
        "eos_token": "[EOS]", "added_tokens_decoder": {str(n): {"content": "[BOS]"}, str(n + 1): {"content": "[EOS]"}},
        "chat_template": "{{ bos_token }}{% for m in messages %}{{ m['content'] }}{% endfor %}", "bos_token": "[BOS]"}))
    tok = find_tokenizer(tmp_path)
    ids = tok.encode("hello world[EOS]")
    assert ids[0] == 259 and ids[-1] == n + 1  # "hello" is one merged token; the special is atomic
    assert tok.decode(ids) == "hello world[EOS]"
    assert tok.eos_token_ids == (n + 1,)
    assert tok.encode(tok.chat_prompt("hello"))[:2] == [n, 259]


def test_bad_tiktoken_line_is_named(tmp_path):
    pytest.importorskip("tiktoken")
    (tmp_path / "tiktoken.model").write_text("QQ== 0\nnot-a-line\n")
    with pytest.raises(TokenizerError, match="tiktoken.model: line 2"):
        find_tokenizer(tmp_path)
