"""Text never loses a run: an id the tokenizer has no token for (a vocabulary wider than the tokenizer, as
padded vocabularies are; random weights emit such ids) shows as `<unk:ID>` in the text, and the tokens are
printed as always. Here a k3-mini checkpoint (vocabulary 512) carries a tiktoken model of the 256 single bytes."""

from __future__ import annotations

import base64
import re

from hostile_util import k3x

from k3x.text.tokenizer import find_tokenizer


def _bytes_tokenizer(folder) -> None:
    (folder / "tokenizer.json").unlink()
    (folder / "tiktoken.model").write_text("".join(f"{base64.b64encode(bytes([b])).decode()} {b}\n"
                                                   for b in range(256)))


def test_decode_marks_an_id_the_tokenizer_lacks(ckpt_dir):
    _bytes_tokenizer(ckpt_dir)
    tok = find_tokenizer(ckpt_dir)
    assert tok.decode([104, 300, 105, 511]) == "h<unk:300>i<unk:511>"
    stream = tok.stream()
    assert "".join(stream.push(t) for t in [104, 400, 105]) + stream.flush() == "h<unk:400>i"


def test_generate_prints_text_and_tokens_past_the_tokenizer(ckpt_dir):
    _bytes_tokenizer(ckpt_dir)
    code, out = k3x("generate", "--checkpoint", ckpt_dir, "--prompt-ids", "1,2,3", "--max-new-tokens", "12")
    assert code == 0, out
    tokens = [int(t) for t in re.search(r"tokens: ([\d,]+)", out)[1].split(",")]
    unknown = [t for t in tokens if t >= 256]
    assert len(tokens) == 12 and unknown, tokens  # random weights reach past the 256 byte tokens
    assert all(f"<unk:{t}>" in out for t in unknown)
