"""Packed expert bytes are read only as config.json declares them: a checkpoint that stores `weight_packed` /
`weight_scale` without the compressed-tensors MXFP4 `quantization_config`, or with a block that says another
format, is refused in one line naming config.json and the field (checkpoint/published.check_quantization),
by every reader (the loader, the exporter, a rank's loader), never read as dense weights."""

from __future__ import annotations

import json

import pytest
from hostile_util import k3x

from k3x.checkpoint.files import CheckpointError, load_checkpoint
from k3x.checkpoint.rank_slices import load_rank
from k3x.model.parallel import ParallelPlan


def _errors(out: str) -> list[str]:
    """The error lines of a command's output (progress lines like `[config] ...` aside)."""
    return [line for line in out.splitlines() if line.startswith("error")]


def _change(ckpt, change) -> None:
    config = json.loads((ckpt / "config.json").read_text())
    change(config)
    (ckpt / "config.json").write_text(json.dumps(config))


def _group(config) -> dict:
    return config["quantization_config"]["config_groups"]["group_0"]


@pytest.mark.parametrize("change, message", [
    (lambda c: c.pop("quantization_config"), "no quantization_config block, yet the checkpoint stores packed"),
    (lambda c: c.update(quantization_config=[1]), "quantization_config must be an object"),
    (lambda c: c["quantization_config"].update(quant_method="awq"), "quantization_config.quant_method='awq'"),
    (lambda c: c["quantization_config"].update(format="nvfp4-pack-quantized"), r"quantization_config.format=\["),
    (lambda c: _group(c).update(format="nvfp4-pack-quantized"), r"quantization_config.format=\["),
    (lambda c: _group(c)["weights"].update(group_size=16), "group_0.weights.group_size=16; MXFP4 is 32"),
    (lambda c: _group(c)["weights"].update(type="int"), "group_0.weights.type='int'"),
], ids=["missing", "not-object", "method", "format", "group-format", "group-size", "int"])
def test_packed_experts_need_the_mxfp4_block(ckpt_dir, change, message):
    _change(ckpt_dir, change)
    with pytest.raises(CheckpointError, match=message):
        load_checkpoint(ckpt_dir)
    code, out = k3x("logits", "--checkpoint", ckpt_dir, "--input-ids", "1,2,3", "--out", ckpt_dir / "l.npy")
    assert code == 1 and len(_errors(out)) == 1 and f"{ckpt_dir / 'config.json'}: " in _errors(out)[0], out
    assert not (ckpt_dir / "l.npy").exists()


def test_the_exporter_and_a_ranks_loader_refuse_it_too(ckpt_dir, tmp_path):
    _change(ckpt_dir, lambda c: c.pop("quantization_config"))
    code, out = k3x("export", "--checkpoint", ckpt_dir, "--target", "pt2", "--out", tmp_path / "x")
    assert code == 1 and len(_errors(out)) == 1 and "no quantization_config block" in _errors(out)[0], out
    assert not (tmp_path / "x").exists()
    with pytest.raises(CheckpointError, match="no quantization_config block"):
        load_rank(ckpt_dir, ParallelPlan(tp=1, ep=2), 0)


def test_the_block_may_sit_in_text_config(ckpt_dir):
    _change(ckpt_dir, lambda c: c["text_config"].update(quantization_config=c.pop("quantization_config")))
    assert load_checkpoint(ckpt_dir).build.expert_format == "mxfp4"
