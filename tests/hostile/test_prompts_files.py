"""Hostile `--prompts` files (text/prompts_file.py): a line of digits is text in a text file (ids only in
.jsonl), JSON lines are read as requests (prompt / prompt_ids / max_tokens; sampling fields equal to the run's),
malformed lines are one line naming the file and line, lines are numbered as an editor counts them (no split
on form feed or \\x1c; one \\r and a leading BOM dropped), and reading is bounded (a FIFO or device is refused
before it is read; the line and file limits are named)."""

from __future__ import annotations

import json
import os

import pytest
from hostile_util import k3x

from k3x.text import prompts_file
from k3x.text.tokenizer import find_tokenizer


def _one_line(code: int, out: str, *needles: str) -> None:
    lines = [ln for ln in out.strip().splitlines() if not ln.startswith("note: ")]
    assert code == 1 and len(lines) == 1 and lines[0].startswith("error: "), out[-800:]
    assert all(n in lines[0] for n in needles) and "CRASH" not in out, out[-800:]


def _serve(folder, prompts, tmp_path, *flags):
    out = tmp_path / "out.json"
    code, text = k3x("run", folder, "--backend", "pt2", "--prompts", prompts, "--max-new-tokens", "2",
                     "--json", out, *flags)
    assert code == 0, text
    return json.loads(out.read_text())


def test_text_lines_are_text_numbered_as_written(serving_dir, tmp_path):
    lines = ["2024", "1,2,3", "hello\x0cworld", "last\x1cline\x0bhere"]
    p = tmp_path / "p.txt"
    p.write_bytes(b"\xef\xbb\xbf" + "\n".join(lines[:3]).encode() + b"\r\n" + lines[3].encode() + b"\n")
    tok = find_tokenizer(serving_dir)
    records = _serve(serving_dir, p, tmp_path)
    assert [r["prompt_tokens"] for r in records] == [len(tok.encode(line)) for line in lines]


def test_jsonl_requests_carry_their_ids_text_and_max_tokens(serving_dir, tmp_path):
    p = tmp_path / "p.jsonl"
    p.write_text('{"prompt_ids": [5, 6, 7], "max_tokens": 1}\n{"prompt": "hi there", "temperature": 0}\n'
                 '{"prompt_ids": [9], "max_tokens": 3, "top_p": 1.0, "seed": null}\n')
    records = _serve(serving_dir, p, tmp_path)
    tok = find_tokenizer(serving_dir)
    assert [r["prompt_tokens"] for r in records] == [3, len(tok.encode("hi there")), 1]
    assert [len(r["tokens"]) for r in records] == [1, 2, 3]


def test_the_format_flag_reads_a_txt_file_as_json_lines(serving_dir, tmp_path):
    p = tmp_path / "p.txt"
    p.write_text('{"prompt_ids": [5, 6, 7]}\n')
    assert [r["prompt_tokens"] for r in _serve(serving_dir, p, tmp_path, "--prompts-format", "jsonl")] == [3]


@pytest.mark.parametrize("line, needle", [
    ("{not json", "p.jsonl:2: not a JSON object"),
    ("[1, 2, 3]", "p.jsonl:2: not a JSON object"),
    ('{"prompt": "a", "prompt_ids": [1]}', 'p.jsonl:2: give one of "prompt"'),
    ('{"prompt_ids": "1,2"}', 'p.jsonl:2: "prompt_ids" must be a list of integers'),
    ('{"prompt_ids": [1, true]}', 'p.jsonl:2: "prompt_ids" must be a list of integers'),
    ('{"prompt_ids": [1, 2.0]}', 'p.jsonl:2: "prompt_ids" must be a list of integers'),
    ('{"prompt_ids": [1, -2]}', "p.jsonl:2: token ids must be in [0, 512)"),
    ('{"prompt_ids": []}', "p.jsonl:2: the prompt has no tokens"),
    ('{"prompt_ids": [1' + "0" * 5000 + "]}", "p.jsonl:2: not a JSON object (the number"),
    ('{"prompt_ids": [1], "max_tokens": 0}', 'p.jsonl:2: "max_tokens" must be an integer >= 1'),
    ('{"prompt_ids": [1], "max_tokens": NaN}', "p.jsonl:2: not a JSON object (NaN is not a JSON number)"),
    ('{"prompt_ids": [1], "temperature": 0.7}', 'p.jsonl:2: "temperature": 0.7 differs from the run\'s --temperature'),
    ('{"prompt_ids": [1], "seed": 4}', 'p.jsonl:2: "seed": 4 differs'),
    ('{"prompt_ids": [1], "stop": ["x"]}', "p.jsonl:2: unknown field 'stop'"),
    ("", "p.jsonl:2: empty line"),
])
def test_a_bad_json_line_is_one_line_naming_it(serving_dir, tmp_path, line, needle):
    p = tmp_path / "p.jsonl"
    p.write_text('{"prompt_ids": [1, 2]}\n' + line + '\n{"prompt_ids": [3]}\n')
    out = tmp_path / "out.json"
    _one_line(*k3x("run", serving_dir, "--prompts", p, "--json", out), needle)
    assert not out.exists()


def test_a_fifo_or_a_device_is_refused_before_it_is_read(serving_dir, tmp_path):
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)  # nobody writes it: reading would wait for ever
    for path in (fifo, "/dev/zero", tmp_path):
        _one_line(*k3x("run", serving_dir, "--prompts", path), f"--prompts {path}: not a regular file")


@pytest.mark.parametrize("limit, data, needle", [
    ("MAX_LINE_BYTES", "hi\n" + "x" * 101 + "\n", "p.txt:2: 101 bytes, over the line limit of 100"),
    ("MAX_FILE_BYTES", "hi\n" * 40, "120 bytes, over the limit of 100"),
])
def test_the_size_limits_are_named(serving_dir, tmp_path, monkeypatch, limit, data, needle):
    monkeypatch.setattr(prompts_file, limit, 100)
    (tmp_path / "p.txt").write_text(data)
    _one_line(*k3x("run", serving_dir, "--prompts", tmp_path / "p.txt"), needle)


def test_prompt_ids_beside_prompts_is_refused(serving_dir, tmp_path):
    (tmp_path / "p.txt").write_text("hello\n")
    _one_line(*k3x("run", serving_dir, "--prompts", tmp_path / "p.txt", "--prompt-ids", "1,2"), "--prompt-ids")
