"""Where a serving step's outputs land (runtime/step_outputs.py): KDA rows written into the pools themselves
when the step's slots are consecutive, scratch buffers reused across steps otherwise; on ONNX Runtime the
in-place step gives exactly what the copying step gives (the graph reads its pool rows before it writes over
them)."""

from __future__ import annotations

import pytest
import torch

from k3x.model.config import preset
from k3x.runtime.pools import StatePools
from k3x.runtime.serve import serving_runner
from k3x.runtime.step_outputs import StepOutputs, consecutive_start, infer_step, narrowed

CFG = preset("k3-mini")


def _feeds(slots: list[int], lens: list[int], past: list[int], block_size: int = 8, width: int = 3) -> dict:
    cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32)
    table = torch.arange(len(slots) * width, dtype=torch.int32).view(len(slots), width)
    gen = torch.Generator().manual_seed(len(lens))
    return {"input_ids": torch.randint(0, CFG.vocab_size, (sum(lens),), generator=gen), "cu_seqlens": cu,
            "past_lens": torch.tensor(past, dtype=torch.int32), "slots": torch.tensor(slots, dtype=torch.int32),
            "block_table": table, "logits_index": cu[1:].long() - 1}


def test_consecutive_start():
    assert consecutive_start(torch.tensor([3, 4, 5])) == 3 and consecutive_start(torch.tensor([0])) == 0
    assert consecutive_start(torch.tensor([1, 3])) is None and consecutive_start(torch.tensor([2, 1])) is None


def test_in_place_rows_and_reused_scratch():
    pools = StatePools(CFG, slots=4, blocks=6, block_size=8)
    outputs = StepOutputs(pools)
    out = outputs.for_step(_feeds([1, 2], [3, 1], [0, 5]), consecutive_start(torch.tensor([1, 2])))
    for pool_name, new_name in pools.names:
        pool, new = pools.tensors[pool_name], out[new_name]
        if pool_name.endswith(".latent"):
            assert new.shape == (4, pool.shape[-1]) and new.untyped_storage().data_ptr() != pool.data_ptr()
        else:
            assert new.data_ptr() == pool[1].data_ptr() and new.shape == (2, *pool.shape[1:])
    scattered = outputs.for_step(_feeds([2, 0], [1, 1], [4, 4]), consecutive_start(torch.tensor([2, 0])))
    not_in_place = outputs.for_step(_feeds([1, 2], [1, 1], [4, 4]), None)
    for pool_name, new_name in pools.names:
        if not pool_name.endswith(".latent"):
            # scratch, the same memory step after step (no fresh allocation to fault in)
            assert scattered[new_name].data_ptr() != pools.tensors[pool_name][2].data_ptr()
            assert scattered[new_name].data_ptr() == not_in_place[new_name].data_ptr()
    assert scattered["new.2.latent"].data_ptr() == out["new.2.latent"].data_ptr()
    grown = outputs.for_step(_feeds([3], [40], [0]), None)  # more latent rows than any step before: a bigger buffer
    assert grown["new.2.latent"].shape[0] == 40


def test_write_back_refuses_in_place_rows_a_sequence_must_keep():
    pools = StatePools(CFG, slots=2, blocks=4, block_size=8)
    feeds = _feeds([0, 1], [1, 1], [2, 2])
    out = {n: t.fill_(1.0) for n, t in StepOutputs(pools).for_step(feeds, 0).items()}
    pools.write_back(feeds, out, keep=[True, True])  # in place: nothing to copy
    assert torch.all(pools.tensors["pool.0.recurrent"] == 1)
    with pytest.raises(ValueError, match="in place, yet a sequence must keep"):
        pools.write_back(feeds, out, keep=[True, False])


@pytest.mark.parametrize("slots", [[1, 2, 3], [0, 1, 2, 3], [3, 0, 2]], ids=["in-place", "whole-pool", "scratch"])
def test_ort_step_into_given_outputs_equals_a_copying_step(serving_export, slots):
    runner = serving_runner("ort", serving_export)
    lens, past = [1, 7, 2, 1][: len(slots)], [5, 0, 9, 3][: len(slots)]
    feeds_of = lambda p: {**_feeds(slots, lens, past), **p.tensors}  # noqa: E731
    copying, binding = (StatePools(CFG, slots=4, blocks=12, block_size=8) for _ in range(2))
    gen = torch.Generator().manual_seed(0)
    for name, t in copying.tensors.items():
        t.normal_(0.0, 0.5, generator=gen)
        binding.tensors[name].copy_(t)
    expect = runner.infer(feeds_of(copying))
    copying.write_back(feeds_of(copying), expect)
    outputs = StepOutputs(binding)
    got = infer_step(runner, feeds_of(binding), outputs)
    in_place = got["new.0.recurrent"].data_ptr() == binding.tensors["pool.0.recurrent"][slots[0]].data_ptr()
    assert in_place == (slots != [3, 0, 2])
    binding.write_back(feeds_of(binding), got)
    assert torch.equal(got["logits"], expect["logits"])
    for name, t in copying.tensors.items():
        assert torch.equal(binding.tensors[name], t), name


def test_narrowed_gives_the_step_rows_as_the_pools():
    pools = StatePools(CFG, slots=5, blocks=6, block_size=8)
    feeds = {**_feeds([2, 3], [1, 1], [4, 4]), **pools.tensors}
    cut = narrowed(feeds, pools, 2)
    assert cut["slots"].tolist() == [0, 1] and cut["slots"].dtype == torch.int32
    for name, t in pools.tensors.items():
        if name.endswith(".latent"):
            assert cut[name] is t
        else:
            assert cut[name].shape[0] == 2 and cut[name].data_ptr() == t[2].data_ptr()
