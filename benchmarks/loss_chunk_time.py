"""The chunked loss's time against its chunk size: what ``FAST_CHUNK_ROWS`` rests on.

    python benchmarks/loss_chunk_time.py [--vocabs 32000,50257,151936] [--tokens 1024]
        [--hidden 256] [--rows 16,32,64,128,256,512,1024] [--threads 1] [--repeats 5]
        [--out FILE]

Forward and backward of a vocabulary projection and its cross-entropy alone (float32, random
hidden states, weight and targets): ``plain`` is ``F.cross_entropy(F.linear(h, W), t)``, ``cN``
is ``fxopt.runtime.chunked_loss`` with N tokens per chunk. Every arm runs once per round in an
order rotated each round, after one warm-up round; ``x plain`` is the median over rounds of the
arm's time over plain's in the same round, with the min-max over rounds.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn.functional as F

from fxopt.bench.environment import TeeOutput, device_name, header
from fxopt.runtime.chunked_loss import chunked_loss


def run_vocab(vocab: int, args: argparse.Namespace, out: TeeOutput) -> None:
    gen = torch.Generator().manual_seed(0)
    h = torch.randn(args.tokens, args.hidden, generator=gen).requires_grad_()
    w = (torch.randn(vocab, args.hidden, generator=gen) * 0.02).requires_grad_()
    t = torch.randint(0, vocab, (args.tokens,), generator=gen)

    def plain() -> None:
        F.cross_entropy(F.linear(h, w), t).backward()

    arms = {"plain": plain}
    for rows in args.rows:
        arms[f"c{rows}"] = lambda rows=rows: chunked_loss(h, w, None, t,
                                                          chunk_rows=rows).backward()
    names = list(arms)
    ratios: dict[str, list[float]] = {name: [] for name in names}
    seconds: dict[str, list[float]] = {name: [] for name in names}
    for round_ in range(args.repeats + 1):
        taken = {}
        for name in names[round_ % len(names):] + names[:round_ % len(names)]:
            h.grad = w.grad = None
            start = time.perf_counter()
            arms[name]()
            taken[name] = time.perf_counter() - start
        if round_ == 0:
            continue  # warm-up
        for name in names:
            ratios[name].append(taken[name] / taken["plain"])
            seconds[name].append(taken[name])
    out(f"\n## vocab {vocab}, {args.tokens} tokens, hidden {args.hidden}, float32")
    out(f"{'arm':<8}{'x plain':>9}{'spread':>13}{'median s':>10}")
    for name in names:
        r = ratios[name]
        out(f"{name:<8}{statistics.median(r):>9.3f}{f'{min(r):.2f}-{max(r):.2f}':>13}"
            f"{statistics.median(seconds[name]):>10.3f}")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--vocabs", default="32000,50257,151936")
    parser.add_argument("--tokens", type=int, default=1024)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--rows", default="16,32,64,128,256,512,1024")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)
    args.rows = [int(r) for r in args.rows.split(",") if r]
    torch.set_num_threads(args.threads)
    out = TeeOutput(args.out)
    for line in header(__file__, device_name("cpu")):
        out(line)
    for vocab in (int(v) for v in args.vocabs.split(",") if v):
        run_vocab(vocab, args, out)


if __name__ == "__main__":
    main()
