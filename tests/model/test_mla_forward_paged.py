"""GatedMLA.forward_paged (model/mla.py): the absorbed serving step over a paged latent pool equals `forward`
(keys and values up-projected from the latent) run per sequence over a growing cache holding the same
latents — outputs and new latents; and it exports under torch.export with N, B, MB, NB dynamic."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from torch.export import Dim

import k3x.custom_ops  # noqa: F401  (registers torch.ops.k3.*)
from k3x.model import preset
from k3x.model.mla import GatedMLA
from paged_cases import paged_case
from tolerances import assert_close


def _mla(output_gate: bool = True, q_lora: bool = True) -> GatedMLA:
    cfg = preset("k3-mini")
    mla = dataclasses.replace(cfg.mla, output_gate=output_gate, q_lora_rank=cfg.mla.q_lora_rank if q_lora else None)
    torch.manual_seed(4)
    m = GatedMLA(dataclasses.replace(cfg, mla=mla))
    with torch.no_grad():  # norms away from ones, so a missing norm would show
        for p in m.parameters():
            if p.dim() == 1:
                p.uniform_(0.5, 1.5)
    return m.eval()


@pytest.mark.parametrize("block_size", [1, 4, 16])
@pytest.mark.parametrize("output_gate,q_lora", [(True, True), (False, False)], ids=["gate-qlora", "plain"])
def test_forward_paged_equals_forward_per_sequence(block_size, output_gate, q_lora):
    m = _mla(output_gate, q_lora)
    d, L = m.o_proj.out_features, m.m.latent_dim
    seqs = [(0, 5), (9, 1), (17, 4), (3, 1), (30, 2)]  # (past, T): prefill, decode rows, chunks with a past
    gen = torch.Generator().manual_seed(2)
    # each sequence's past comes from the same module run on its own past tokens, so the cache is realistic
    past_x = [torch.randn(1, p, d, generator=gen) for p, _ in seqs]
    x = torch.randn(sum(t for _, t in seqs), d, generator=gen)
    case = paged_case(seqs, block_size, L, strided=True)
    with torch.no_grad():
        for b, px in enumerate(past_x):  # the runtime's write-back of earlier steps: latents into the pool
            _, hist = m(px, torch.zeros(1, 0, L))
            bs = block_size
            for p in range(seqs[b][0]):
                case.pool[case.block_table[b, p // bs], p % bs] = hist[0, p]
            case.history[b] = hist[0]
        y, new_latent = m.forward_paged(x, *case.paged, kernels="reference")
        cu = case.cu_seqlens.tolist()
        for b, hist in enumerate(case.history):
            rows = slice(cu[b], cu[b + 1])
            y_b, present = m(x[None, rows], hist[None])
            assert_close(y[rows], y_b[0], torch.float32, f"y of sequence {b}")
            assert_close(new_latent[rows], present[0, hist.shape[0]:], torch.float32, f"new latent of sequence {b}")
    assert y.shape == x.shape and new_latent.shape == (x.shape[0], L)


class _Step(torch.nn.Module):
    def __init__(self, mla: GatedMLA) -> None:
        super().__init__()
        self.mla = mla

    def forward(self, x, pool, block_table, past_lens, cu_seqlens):
        return self.mla.forward_paged(x, pool, block_table, past_lens, cu_seqlens, kernels="reference")


def test_forward_paged_exports_with_dynamic_step_dims():
    m = _mla()
    d, L = m.o_proj.out_features, m.m.latent_dim
    case = paged_case([(6, 3), (0, 2)], 4, L)
    x = torch.randn(5, d)
    dims = {"x": {0: Dim("N", min=1)}, "pool": {0: Dim("NB", min=1)}, "block_table": {0: Dim("B", min=1),
            1: Dim("MB", min=1)}, "past_lens": {0: Dim("B", min=1)}, "cu_seqlens": {0: Dim("B1", min=2)}}
    step = _Step(m)
    ep = torch.export.export(step, (x, *case.paged), dynamic_shapes=dims, strict=False)
    other = paged_case([(1, 1), (13, 1), (0, 7), (2, 2)], 4, L, spare_blocks=6)  # every dynamic dim differs
    x2 = torch.randn(other.latent.shape[0], d)
    with torch.no_grad():
        got, want = ep.module()(x2, *other.paged), step(x2, *other.paged)
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w)
    assert sum(n.target == torch.ops.k3.mla_paged.default for n in ep.graph.nodes) == 1
