"""Streamed text is what a person reads: special tokens left out, a UTF-8 character split across tokens
held back until it completes, one still incomplete when decoding stops never shown as U+FFFD."""

from __future__ import annotations

import pytest

from k3x.text.tiny_tokenizer import tokenizer_files
from k3x.text.tokenizer import find_tokenizer


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    d = tmp_path_factory.mktemp("stream")
    for name, data in tokenizer_files(512).items():
        (d / name).write_bytes(data)
    return find_tokenizer(d)


def _stream(tok, ids: list[int]) -> tuple[list[str], str]:
    s = tok.stream()
    return [s.push(i) for i in ids], s.flush()


def test_special_tokens_are_not_streamed(tok):
    specials = [tok.backend.token_id(t) for t in ("<|bos|>", "<|assistant|>", "<|eos|>")]
    pushed, rest = _stream(tok, [specials[0], specials[1], *tok.encode("Hello"), specials[2]])
    assert "".join(pushed) + rest == "Hello" and "<|" not in "".join(pushed)
    assert tok.decode(specials) == "<|bos|><|assistant|><|eos|>"  # plain decode keeps them


def test_a_split_character_is_held_until_complete_and_never_shown_half(tok):
    ids = tok.encode("日本")  # byte-level: each character spans several tokens
    assert len(ids) > 2
    pushed, rest = _stream(tok, ids)
    assert "".join(pushed) == "日本" and all("\ufffd" not in p for p in pushed) and rest == ""
    pushed, rest = _stream(tok, ids[:-1])  # decoding stopped inside the second character
    assert "".join(pushed) + rest == "日" and "\ufffd" not in rest
