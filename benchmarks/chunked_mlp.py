"""The ``chunked_mlp`` pass at ``memory_budget="min"``: a language model's training-step peak and
time with its MLPs chunked over tokens, against the same plan without them and against Hugging
Face's gradient checkpointing.

    python benchmarks/chunked_mlp.py [--models llama,qwen2] [--hidden 256] [--layers 4]
        [--seq 2048] [--batch 2] [--vocab 8000] [--repeats 5] [--threads 1] [--out FILE]

Each model is built random-init from a config with ``intermediate_size = 4 x hidden`` (so the
MLP's intermediate is the widest activation, as in Llama 3's 2,048 -> 8,192), trained in
float32 as ``model(input_ids=ids, labels=ids).loss.backward()``. Arms, all in this process:

- ``original``; ``hf_gc``: ``gradient_checkpointing_enable()`` (one checkpoint per layer);
- ``min_without``: ``fxopt.optimize(..., memory_budget="min", outputs="loss")`` with every
  default pass but ``chunked_mlp``;
- ``min``: the same with it (the default pipeline).

``step MiB``: one forward + backward's peak above the parameters, buffers and inputs, counted
exactly (``fxopt.measure_train_step``: live storages, parameter gradients included);
``time x``: the median step time over the original's, all arms timed alternately in one run
(``fxopt.bench.spread.alternated_step_times``), with the 10th-90th percentile spread of the
arm's samples over their median.
"""

from __future__ import annotations

import argparse
import copy
import sys
import time
import warnings

import torch
from torch import nn

import fxopt
from fxopt.bench.environment import TeeOutput, device_name, header
from fxopt.bench.spread import alternated_step_times
from fxopt.passes import REGISTRY

SEED = 0


class LossOf(nn.Module):
    """``model(input_ids=ids, labels=ids).loss`` as a module of one positional input."""

    def __init__(self, model: nn.Module):
        super().__init__()
        self.model = model

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids=ids, labels=ids).loss


def build(name: str, args: argparse.Namespace) -> nn.Module:
    import transformers

    torch.manual_seed(SEED)
    sizes = dict(num_hidden_layers=args.layers, hidden_size=args.hidden,
                 intermediate_size=4 * args.hidden, num_attention_heads=4, num_key_value_heads=4,
                 max_position_embeddings=args.seq, vocab_size=args.vocab, use_cache=False)
    if name == "llama":
        return transformers.LlamaForCausalLM(transformers.LlamaConfig(**sizes)).train()
    if name == "qwen2":
        return transformers.Qwen2ForCausalLM(transformers.Qwen2Config(
            **sizes, tie_word_embeddings=False)).train()
    raise SystemExit(f"unknown model {name!r}: choose from llama, qwen2")


def arms(name: str, args: argparse.Namespace, kw: dict) -> dict[str, tuple[nn.Module, str]]:
    original = build(name, args)
    hf = copy.deepcopy(original)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        hf.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    found = {"original": (original, ""), "hf_gc": (hf, "one checkpoint per decoder layer")}
    without = [s.name for s in REGISTRY
               if (s.default or s.always or s.budget) and s.name != "chunked_mlp"]
    for arm, passes in (("min_without", without), ("min", None)):
        start = time.perf_counter()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            gm = fxopt.optimize(copy.deepcopy(original), (), example_kwargs=kw,
                                memory_budget="min", outputs="loss", passes=passes)
        records = {r.name: r for r in gm.fxopt_report.passes}
        regions = len(records["checkpoint"].stats.get("regions", ()))
        mlp = records.get("chunked_mlp")
        chunks = ""
        if mlp is not None and mlp.modified:
            site = mlp.stats["sites"][0]
            chunks = (f"; {mlp.stats['rewritten']} MLPs in chunks of {site['rows_per_chunk']} "
                      f"of {site['tokens']} tokens")
        found[arm] = (gm, f"optimize {time.perf_counter() - start:.0f} s; {regions} regions"
                          f"{chunks}")
    return found


def run_model(name: str, args: argparse.Namespace, out: TeeOutput) -> None:
    ids = torch.randint(0, args.vocab, (args.batch, args.seq),
                        generator=torch.Generator().manual_seed(SEED + 1))
    kw = {"input_ids": ids, "labels": ids}
    found = arms(name, args, kw)
    params = sum(p.numel() for p in found["original"][0].parameters())
    out(f"## {name}: hidden {args.hidden}, intermediate {4 * args.hidden}, {args.layers} layers, "
        f"{args.batch} x {args.seq} tokens, vocab {args.vocab}, {params:,} parameters, "
        "float32")
    peaks = {arm: fxopt.measure_train_step(module, (), kw).step_peak_bytes
             for arm, (module, _) in found.items()}
    times = alternated_step_times([LossOf(m) for m, _ in found.values()], (ids,), args.repeats)
    base = times[0].median
    out(f"{'arm':<12} {'step MiB':>9} {'x HF':>6} {'time x':>7} {'spread':>7}  note")
    for (arm, (_, note)), sample in zip(found.items(), times):
        out(f"{arm:<12} {peaks[arm] / 2**20:9.1f} {peaks[arm] / peaks['hf_gc']:6.2f} "
            f"{sample.median / base:7.3f} {sample.spread:7.2f}  {note}")
    out()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--models", default="llama,qwen2")
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--seq", type=int, default=2048)
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--vocab", type=int, default=8000)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    out = TeeOutput(args.out)
    import transformers

    for line in header(__file__, f"{device_name('cpu')}, {args.threads} thread(s)",
                       f"transformers {transformers.__version__}"):
        out(line)
    for name in args.models.split(","):
        run_model(name, args, out)


if __name__ == "__main__":
    sys.exit(main())
