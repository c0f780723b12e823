"""k3::mla_paged's CPU implementation in key blocks (custom_ops/mla_paged/blocked.py) against the simple oracle
(reference.py) on fresh random inputs: past 0, partially filled pool blocks, one-row steps, many sequences,
pasts and steps on and around key-block boundaries; the registered op runs it (KEY_BLOCK read per call); and
its temporaries, counted op by op (model/working.py LiveBytes), stay under `working_bytes` and do not grow
with the context, where the oracle's do."""

from __future__ import annotations

import pytest
import torch

import k3x.custom_ops  # noqa: F401  (registers torch.ops.k3.*)
from k3x.custom_ops.mla_paged import blocked
from k3x.custom_ops.mla_paged.reference import mla_paged as oracle
from k3x.model.working import LiveBytes
from paged_cases import paged_case
from tolerances import assert_close

C, R, H = 12, 5, 3
KB = 8  # key block of these tests: two pool blocks of 4

CASES = {  # (past, T) per sequence, around KB = 8
    "past0-T1": [(0, 1)],
    "past0-step-crosses-blocks": [(0, 21)],
    "partial-pool-block": [(5, 3)],
    "past-on-boundaries": [(8, 1), (16, 2), (7, 1), (9, 3)],
    "step-on-boundaries": [(3, 8), (8, 9), (0, 16), (1, 7)],
    "many-sequences": [(31, 1), (0, 1), (16, 3), (1, 1), (8, 8), (15, 2), (2, 13), (40, 1), (23, 17)],
}


def queries(N: int, dtype, seed: int):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(N, H, C, generator=g, dtype=torch.float64).to(dtype),
            torch.randn(N, H, R, generator=g, dtype=torch.float64).to(dtype))


def random_seqs(seed: int) -> list[tuple[int, int]]:
    g = torch.Generator().manual_seed(seed)
    B = int(torch.randint(1, 8, (1,), generator=g))
    return [(int(torch.randint(0, 50, (1,), generator=g)), int(torch.randint(1, 20, (1,), generator=g)))
            for _ in range(B)]


def run_both(seqs, dtype, seed, block_size=4, key_block=KB):
    case = paged_case(seqs, block_size, C + R, dtype=dtype, gen=torch.Generator().manual_seed(seed),
                      strided=seed % 2 == 1)
    ql, qr = queries(case.latent.shape[0], dtype, seed + 100)
    got = blocked.mla_paged(ql, qr, case.latent, *case.paged, 0.3, key_block=key_block)
    return got, oracle(ql, qr, case.latent, *case.paged, 0.3)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16], ids=["fp32", "fp64", "bf16"])
@pytest.mark.parametrize("name", sorted(CASES))
def test_blocked_equals_oracle(name, dtype):
    got, want = run_both(CASES[name], dtype, seed=len(name))
    assert got.dtype == dtype and got.shape == want.shape
    assert_close(got, want, dtype, name)


@pytest.mark.parametrize("seed", range(6))
def test_blocked_equals_oracle_on_random_steps(seed):
    """Random batches (1-7 sequences, pasts 0-49, steps 1-19), pool blocks of 1, 4 or 16, key blocks that
    round to whole pool blocks (3 -> 4 with BS 4; 5 -> 16 with BS 16)."""
    block_size, key_block = [(1, 3), (4, 3), (4, 12), (16, 5), (1, 1), (4, 8)][seed]
    seqs = random_seqs(seed)
    got, want = run_both(seqs, torch.float64, seed, block_size, key_block)
    assert_close(got, want, torch.float64, f"{seqs} BS={block_size} KB={key_block}")


def test_key_block_rounds_to_whole_pool_blocks():
    assert [blocked.key_block_for(bs, kb) for bs, kb in [(4, 8), (4, 10), (16, 5), (1, 3)]] == [8, 8, 16, 3]


def test_the_registered_op_runs_in_key_blocks(monkeypatch):
    """torch.ops.k3.mla_paged with the reference kernels runs blocked.py with KEY_BLOCK as it is at the call."""
    case = paged_case([(37, 5), (0, 11)], 4, C + R)
    ql, qr = queries(case.latent.shape[0], torch.float32, 3)
    seen = []
    add = blocked.Online.add
    monkeypatch.setattr(blocked.Online, "add", lambda self, *a, **k: seen.append(a[1].shape[0]) or add(self, *a, **k))
    monkeypatch.setattr(blocked, "KEY_BLOCK", 8)
    out = torch.ops.k3.mla_paged(ql, qr, case.latent, *case.paged, 0.3, "reference")
    assert seen == [8, 8, 8, 8, 5, 5, 8, 3]  # 37 past keys in blocks of 8, then the steps' 5 and 8 + 3 rows
    assert torch.equal(out, blocked.mla_paged(ql, qr, case.latent, *case.paged, 0.3, key_block=8))


def peak_bytes(fn, seqs, block_size=16):
    """Peak live bytes of the tensors `fn` creates (its inputs not counted): C = 24, R = 8, H heads."""
    case = paged_case(seqs, block_size, 24 + 8)
    g = torch.Generator().manual_seed(1)
    N = case.latent.shape[0]
    args = (torch.randn(N, H, 24, generator=g), torch.randn(N, H, 8, generator=g), case.latent, *case.paged)
    with LiveBytes(known=list(args)) as m:
        fn(*args, 0.3)
    return m.peak


@pytest.mark.parametrize("T", [1, 40])
def test_temporaries_do_not_grow_with_the_context(T):
    """A few thousand past positions in key blocks of 64: the blocked op's peak live bytes equal those at a
    short past (two key blocks) and stay under `working_bytes` (from the shapes); the oracle's grow with the
    past (its [H, T, P + T] scores), so this count would catch a path that materialises the context."""
    run = lambda *a: blocked.mla_paged(*a, key_block=64)  # noqa: E731
    short, long = peak_bytes(run, [(130, T)]), peak_bytes(run, [(3000, T)])
    bound = blocked.working_bytes(T, H, 24, 8, 16, key_block=64)
    assert long <= bound and long <= short * 1.02, (short, long, bound)
    assert peak_bytes(oracle, [(3000, T)]) > 4 * bound
