"""Speculative decoding figures on the CPU: acceptance and decode tokens/s vs plain greedy decoding.

A random-weight model does not continue text it has seen, so n-gram drafts of it are never accepted. The
figure uses an "echo" variant of `--preset` (`echo_model`): the lm_head tied to the token embedding and every
block's output projection scaled by `--mix` (0: the model repeats its last token; 0.5: mostly, with changes),
the same shapes and work per token as the random model. Exported (`--serving`, ort flavor) into a temp folder
through a checkpoint, served by the ORT runner over a repetitive prompt set (short patterns repeated), plain
and with `ngram:K` drafts, the runs interleaved and repeated (median):
  - acceptance rate, tokens per sequence-step, decode tokens/s of both and their ratio (decode time = a run's
    wall time less that of the same prompts with one new token: the prefill and first token);
  - the extra memory for rollback per sequence: none for the target (runtime/speculate.py: a rejected step's
    KDA rows are not written back) vs K per-position states (what a state window would hold), for the preset
    and for K3.
The tokens of both runs are checked equal. Prints a table and writes JSON (--json).

    python -m k3x.bench.speculate [--preset k3-bench] [--tokens 4] [--new 64] [--mix 0.5] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path


def echo_model(preset_name: str, mix: float, seed: int = 0):
    """`preset_name` with random weights (`seed`), its lm_head the token embedding and each block's output
    projection (attention o_proj, MLP and expert down projections) scaled by `mix`."""
    import torch

    from k3x.model import build_model, preset

    model = build_model(preset(preset_name), dtype=torch.float32, seed=seed).eval()
    with torch.no_grad():
        model.lm_head.weight.copy_(model.model.embed_tokens.weight)
        for name, p in model.named_parameters():
            if name.endswith(("o_proj.weight", "mlp.down_proj.weight", "experts.down_proj.weight", "experts.w2")):
                p.mul_(mix)
    return model


def export_echo(preset_name: str, mix: float, out: Path, *, seed: int = 0, block_size: int = 16,
                targets: tuple[str, ...] = ("onnx",)) -> Path:
    """The echo model saved as a checkpoint (out/ckpt) and exported with --serving (out/export) -> the export."""
    from k3x.checkpoint.save import save_checkpoint
    from k3x.exporter.options import ExportOptions, Target
    from k3x.exporter.pipeline import export

    save_checkpoint(echo_model(preset_name, mix, seed), out / "ckpt", expert_format="dense")
    export(ExportOptions(tuple(Target(t) for t in targets), out / "export", checkpoint=out / "ckpt", serving=True,
                         block_size=block_size))
    return out / "export"


def repetitive_prompts(n: int, length: int, vocab_size: int, seed: int = 0) -> list[list[int]]:
    """`n` prompts of `length` tokens: a random pattern of 2..8 tokens repeated."""
    import torch

    g = torch.Generator().manual_seed(seed)
    out = []
    for i in range(n):
        pattern = torch.randint(0, vocab_size, (2 + i % 7,), generator=g).tolist()
        out.append((pattern * (length // len(pattern) + 1))[:length])
    return out


def timed_serve(runner, cfg, prompts, new: int, block_size: int, drafter=None):
    """One serve run -> (seconds, records)."""
    from k3x.runtime.serve import ServeOptions, serve
    from k3x.text.sampling import SamplingOptions

    opts = ServeOptions(max_sequences=len(prompts), block_size=block_size, max_step_tokens=4096)
    t = time.perf_counter()
    records = serve(runner, cfg, prompts, SamplingOptions(max_new_tokens=new), opts, drafter=drafter)
    return time.perf_counter() - t, records


def measure(runner, cfg, prompts, *, new: int, k: int, block_size: int, repeats: int) -> dict:
    """Plain and n-gram runs interleaved (each first in turn), with their prefill-only runs -> figures."""
    from k3x.runtime.speculate import Counts, NgramDrafter

    cases = {"plain": (new, None), "ngram": (new, k), "prefill": (1, None)}
    times: dict[str, list[float]] = {c: [] for c in cases}
    records = {}
    names = list(cases)
    for i in range(repeats):
        for c in names[i % 3:] + names[: i % 3]:
            n, kk = cases[c]
            s, records[c] = timed_serve(runner, cfg, prompts, n, block_size, kk and NgramDrafter(kk))
            times[c].append(s)
    if [r.tokens for r in records["plain"]] != [r.tokens for r in records["ngram"]]:
        raise AssertionError("speculation changed the tokens")
    med = {c: statistics.median(v) for c, v in times.items()}
    total = Counts()
    for r in records["ngram"]:
        total.add(r.counts)
    decode_tokens = sum(len(r.tokens) - 1 for r in records["plain"])
    plain_tps, spec_tps = (decode_tokens / (med[c] - med["prefill"]) for c in ("plain", "ngram"))
    return {"acceptance": total.acceptance, "tokens_per_step": total.tokens_per_step, "drafted": total.drafted,
            "accepted": total.accepted, "plain_s": med["plain"], "ngram_s": med["ngram"], "prefill_s": med["prefill"],
            "plain_decode_tokens_per_s": plain_tps, "ngram_decode_tokens_per_s": spec_tps,
            "speedup": spec_tps / plain_tps}


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--preset", default="k3-bench")
    p.add_argument("--mix", type=float, default=0.5)
    p.add_argument("--tokens", type=int, default=4, help="K: draft tokens per step")
    p.add_argument("--prompts", type=int, default=8)
    p.add_argument("--length", type=int, default=48, help="prompt tokens")
    p.add_argument("--new", type=int, default=64, help="new tokens per prompt")
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--threads", type=int, default=0, help="ONNX Runtime intra-op threads (0: its default)")
    p.add_argument("--json", type=Path)
    a = p.parse_args(argv)
    from k3x.model import preset
    from k3x.model.state import state_bytes
    from k3x.runtime.runners import RunnerOptions
    from k3x.runtime.serve import serving_runner

    cfg = preset(a.preset)
    prompts = repetitive_prompts(a.prompts, a.length, cfg.vocab_size)
    with tempfile.TemporaryDirectory() as tmp:
        folder = export_echo(a.preset, a.mix, Path(tmp), block_size=a.block_size)
        runner = serving_runner("ort", folder, RunnerOptions(intra_op_threads=a.threads))
        r = measure(runner, cfg, prompts, new=a.new, k=a.tokens, block_size=a.block_size, repeats=a.repeats)
    per_pos = {name: state_bytes(preset(name))["kda_state_bytes_per_sequence"] for name in (a.preset, "k3")}
    r = {"preset": a.preset, "mix": a.mix, "k": a.tokens, "prompts": a.prompts, "new_tokens": a.new, **r,
         "rollback_bytes_per_sequence": 0,
         "window_bytes_per_sequence": {n: a.tokens * b for n, b in per_pos.items()}}
    print(f"{a.preset} (echo weights, mix {a.mix}), ORT CPU, {a.prompts} repetitive prompts x {a.new} new tokens, "
          f"ngram:{a.tokens}:\n"
          f"  acceptance {r['acceptance']:.1%} ({r['accepted']}/{r['drafted']}), "
          f"{r['tokens_per_step']:.2f} tokens per sequence-step\n"
          f"  decode: plain {r['plain_decode_tokens_per_s']:8.1f} tokens/s, ngram {r['ngram_decode_tokens_per_s']:8.1f}"
          f" tokens/s  ({r['speedup']:.2f}x)\n"
          f"  rollback memory per sequence: 0 B (rejected rows not written back); a {a.tokens}-position state "
          f"window would hold " + ", ".join(f"{n} {b / 2**20:,.1f} MiB" for n, b in
                                           r["window_bytes_per_sequence"].items()))
    if a.json:
        a.json.write_text(json.dumps(r, indent=1) + "\n")
    return r


if __name__ == "__main__":
    main()
