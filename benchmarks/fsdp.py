"""FSDP2 on CPU: per-rank step peak, resident memory and step time of a Llama, per arm.

    python benchmarks/fsdp.py [--vocab 32000] [--hidden 256] [--layers 4] [--seq 256]
        [--batch 2] [--rounds 5] [--out FILE]

Two processes (gloo, one thread each) build ``LlamaForCausalLM`` from a config (random weights,
no download), float32, called as Hugging Face models are (``model(input_ids=ids, labels=ids)``),
and shard it with ``fully_shard`` per decoder layer, then the root (``fxopt.bench.sharded``).
Arms, each from the same seed:

- ``fsdp2``: plain FSDP2;
- ``fsdp2+hf_gc``: with ``gradient_checkpointing_enable(use_reentrant=False)`` first;
- ``fsdp2+fxopt_min``: ``fxopt.optimize(model, memory_budget="min", shard_blocks=True)`` first
  (verified there; planned knowing each layer's gradients leave when its backward ends),
  sharded at the same layer paths (``fxopt.blocks(optimized)``).

The fused optimizer step (``fxopt.fuse_optimizer``) is not an arm: it steps a parameter when
its gradient is accumulated, and FSDP2 hands the gradient to the sharded parameter by
assignment after its reduce-scatter, so the step would never run.

Columns, per rank (rank 0 printed; the ranks see the same sizes):

- ``step MiB``: bytes of the storages allocated during one training step (forward,
  ``loss.backward()``, AdamW step, ``zero_grad``) at their peak, counted exactly with
  ``LiveStorageTracker(follow_resizes=True)``, at step 2 (AdamW's moments exist);
- ``resident MiB``: every real tensor storage the process can reach after step 2, beyond what
  it held before the arm was built (``fxopt.bench.sharded.resident_bytes``: parameter shards,
  AdamW state, and whatever else anything keeps alive, found through the garbage collector);
- ``time x fsdp2``: step time over plain FSDP2's, ``--rounds`` rounds of one step per arm in an
  order rotated each round; the median of the per-round ratios and their min-max.
"""

from __future__ import annotations

import argparse
import datetime
import gc
import os
import statistics
import sys
import tempfile
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import fxopt  # noqa: E402
from fxopt.bench.environment import TeeOutput, code_commit  # noqa: E402
from fxopt.bench.sharded import ShardedStep, live_storages, shard_per_block  # noqa: E402

ARMS = ("fsdp2", "fsdp2+hf_gc", "fsdp2+fxopt_min")
MiB = 2 ** 20


def build(arm: str, args: argparse.Namespace) -> tuple[torch.nn.Module, list[str]]:
    import transformers

    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=4 * args.hidden,
        num_hidden_layers=args.layers, num_attention_heads=4, num_key_value_heads=4,
        max_position_embeddings=max(2048, args.seq), use_cache=False))
    blocks = [f"model.layers.{i}" for i in range(args.layers)]
    if arm == "fsdp2+hf_gc":
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    elif arm == "fsdp2+fxopt_min":
        ids = tokens(args, 0, 0)
        model = fxopt.optimize(model, (), example_kwargs={"input_ids": ids, "labels": ids},
                               memory_budget="min", shard_blocks=True)
        blocks = fxopt.blocks(model)
    return model, blocks


def tokens(args: argparse.Namespace, rank: int, step: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(1000 * rank + step)
    return torch.randint(0, args.vocab, (args.batch, args.seq), generator=generator)


def _worker(rank: int, init_file: str, args: argparse.Namespace, results: dict) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=2,
                            timeout=datetime.timedelta(seconds=1800))
    gc.freeze()  # what the imports made is never garbage: resident_bytes need not scan it
    try:
        runs = {}
        for arm in ARMS:  # each arm's storages are those that appear from its build on
            baseline = live_storages()
            model, blocks = build(arm, args)
            shard_per_block(model, blocks)
            runs[arm] = ShardedStep(
                model, lambda m, step: m(input_ids=(ids := tokens(args, rank, step)),
                                         labels=ids).loss,
                torch.optim.AdamW(model.parameters(), lr=1e-4), baseline=baseline)
            del model
            for step in range(3):  # step 2 is measured: AdamW's moments exist
                runs[arm].run(step, measure=step == 2)
        for round_ in range(args.rounds):
            for arm in ARMS[round_ % len(ARMS):] + ARMS[:round_ % len(ARMS)]:
                runs[arm].run(3 + round_, measure=False)
        if rank == 0:
            for arm in ARMS:
                run = runs[arm]
                results[arm] = {"peak": run.peaks[-1], "resident": run.resident[-1],
                                "seconds": list(run.seconds), "losses": run.losses}
        dist.barrier()
    finally:
        dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--seq", type=int, default=256)
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    out = TeeOutput(args.out)
    out(f"# FSDP2 on CPU, 2 gloo processes, 1 thread each -- {datetime.date.today().isoformat()}, "
        f"torch {torch.__version__}, commit {code_commit() or 'unknown'}")
    out(f"# command: python benchmarks/fsdp.py {' '.join(sys.argv[1:])}")
    out(f"# LlamaForCausalLM vocab {args.vocab}, hidden {args.hidden}, {args.layers} layers, "
        f"seq {args.seq}, batch {args.batch} per rank, float32, AdamW")
    with tempfile.TemporaryDirectory() as tmp, mp.Manager() as manager:
        shared = manager.dict()
        mp.spawn(_worker, args=(os.path.join(tmp, "rdv"), args, shared), nprocs=2, join=True)
        results = dict(shared)
    reference = results["fsdp2"]
    ratios = {arm: [a / b for a, b in zip(results[arm]["seconds"], reference["seconds"],
                                           strict=True)] for arm in ARMS}
    out()
    out(f"{'arm':<18} {'step MiB':>9} {'x fsdp2':>8} {'resident MiB':>13} "
        f"{'time x fsdp2':>13} {'(min-max)':>12} {'median s':>9}")
    for arm in ARMS:
        r = results[arm]
        out(f"{arm:<18} {r['peak'] / MiB:>9.1f} {r['peak'] / reference['peak']:>8.2f} "
            f"{r['resident'] / MiB:>13.1f} {statistics.median(ratios[arm]):>13.2f} "
            f"{min(ratios[arm]):>5.2f}-{max(ratios[arm]):<6.2f} "
            f"{statistics.median(r['seconds']):>9.3f}")
    out()
    for arm in ARMS[1:]:
        worst = max(abs(a - b) / abs(b) for a, b in zip(results[arm]["losses"],
                                                        reference["losses"], strict=True))
        out(f"{arm}: largest relative difference of a step's loss from plain FSDP2's: {worst:.1e}")


if __name__ == "__main__":
    main()
