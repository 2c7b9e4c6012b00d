"""Language models: the loss off the peak. Whole training-step peak and step time, per arm.

    python benchmarks/lm_memory.py [--models llama,llama:128256,gpt2,qwen2] [--vocab N]
        [--hidden 256]
        [--layers 4] [--seq 512] [--batch 2] [--threads 1] [--repeats 5] [--inner 1]
        [--arms original,hf_gc,min,min_chunked,min_chunked_loss,min_chunked_loss_fused]
        [--out FILE]

Causal language models built from configs with random weights (no download), float32 on CPU,
called as Hugging Face models are, ``model(input_ids=ids, labels=ids)`` (the loss is computed in
forward, the logits are returned too). ``llama``: ``LlamaForCausalLM`` (intermediate size
4 x hidden, 4 heads, 4 key/value heads; vocab 32,000 by default); ``gpt2``: ``GPT2LMHeadModel``
(tied input/output embeddings; vocab 50,257); ``qwen2``: ``Qwen2ForCausalLM`` (vocab 151,936).
``name:N`` takes vocab N for that model (``llama:128256``: Llama 3's vocabulary); the default runs
the four configurations of issue 24, Llama at 32,000 and 128,256, GPT-2 and Qwen2.
``--vocab`` overrides the vocabulary of every model.

Arms, each on its own model built from the same seed:

- ``original``: the model as built;
- ``hf_gc``: ``gradient_checkpointing_enable(use_reentrant=False)``, Hugging Face's recipe;
- ``min``: ``fxopt.optimize(model, (), example_kwargs=kw, memory_budget="min")``;
- ``min_chunked``: the same with the ``chunked_loss`` pass (faithful: the logits are returned);
- ``min_chunked_loss``: with ``("chunked_loss", {"outputs": "loss"})``: the logits the model
  returns are never built in a training step;
- ``min_chunked_loss_fused``: the previous, planned and run with fxopt's fused AdamW step
  (``fxopt.fuse_optimizer``: each parameter updated, and its gradient freed, during backward).

Every fxopt arm is verified by ``optimize`` (loss, every gradient, the outputs). Columns:

- ``step MiB``: the whole training-step peak at step 2 (AdamW's moments exist since step 1):
  parameters, buffers, inputs, optimizer state and gradients alive when the step starts, plus
  every tensor storage allocated during forward, ``loss.backward()``, ``optimizer.step()`` and
  ``zero_grad()``, counted exactly (``fxopt.analysis.memtrack.LiveStorageTracker``). The step's
  output (loss and logits) is kept until the step ends, as a training loop's ``out`` is;
- ``x HF``: this arm's peak over HF checkpointing's;
- ``fwd+bwd MiB``: ``fxopt.measure_train_step`` (forward and backward, no optimizer);
- ``time x HF``: step time (forward, backward, optimizer step) over HF checkpointing's:
  ``--repeats`` rounds, each running ``--inner`` steps of every arm in an order rotated each
  round; per round the ratio of medians; the median ratio and the min-max over rounds.
  ``median s``: the arm's median step time over all rounds.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from torch import nn

from fxopt import passes
from fxopt.analysis.memtrack import LiveStorageTracker
from fxopt.api import optimize
from fxopt.bench.environment import TeeOutput, device_name, header
from fxopt.core.tensors import storage_bytes, tensors_in
from fxopt.measure.peaks import measure_train_step
from fxopt.runtime.fuse import fuse_optimizer

MiB = 2**20
SEED = 0
VOCABS = {"llama": 32000, "gpt2": 50257, "qwen2": 151936}
ARMS = ("original", "hf_gc", "min", "min_chunked", "min_chunked_loss", "min_chunked_loss_fused")
ADAMW = {"lr": 1e-4, "weight_decay": 1e-2}


def model_spec(spec: str, args: argparse.Namespace) -> tuple[str, int]:
    """``"llama:128256"`` -> ("llama", 128256); without ``:N``, ``--vocab`` or the model's own."""
    name, _, vocab = spec.partition(":")
    if name not in VOCABS:
        raise SystemExit(f"unknown model {name!r}: choose from {', '.join(VOCABS)}")
    return name, int(vocab) if vocab else (args.vocab or VOCABS[name])


def build(spec: str, args: argparse.Namespace) -> nn.Module:
    import transformers

    torch.manual_seed(SEED)
    name, vocab = model_spec(spec, args)
    if name == "llama":
        config = transformers.LlamaConfig(
            num_hidden_layers=args.layers, hidden_size=args.hidden,
            intermediate_size=4 * args.hidden, num_attention_heads=4, num_key_value_heads=4,
            max_position_embeddings=args.seq, vocab_size=vocab, use_cache=False)
        model = transformers.LlamaForCausalLM(config)
    elif name == "gpt2":
        config = transformers.GPT2Config(n_layer=args.layers, n_embd=args.hidden, n_head=4,
                                          n_positions=args.seq, vocab_size=vocab,
                                          use_cache=False, bos_token_id=0, eos_token_id=0)
        model = transformers.GPT2LMHeadModel(config)
        model.loss_type = "ForCausalLM"
    elif name == "qwen2":
        config = transformers.Qwen2Config(
            num_hidden_layers=args.layers, hidden_size=args.hidden,
            intermediate_size=4 * args.hidden, num_attention_heads=4, num_key_value_heads=4,
            max_position_embeddings=args.seq, vocab_size=vocab, use_cache=False,
            tie_word_embeddings=False)
        model = transformers.Qwen2ForCausalLM(config)
    else:
        raise SystemExit(f"unknown model {name!r}: choose from {', '.join(VOCABS)}")
    return model.train()


def pipeline(outputs: str | None) -> list:
    """The default passes, plus chunked_loss with ``outputs`` (None: without it)."""
    chosen = []
    for spec in passes.REGISTRY:
        if spec.name == "chunked_loss" and outputs is not None:
            chosen.append(("chunked_loss", {"outputs": outputs}))
        elif spec.default:
            chosen.append(spec.name)
    return chosen


class Arm:
    """One arm: its module, its optimizer (ordinary or fused AdamW), figures."""

    def __init__(self, name: str, module: nn.Module, fused: bool, note: str):
        self.name, self.module, self.fused, self.note = name, module, fused, note
        self.opt = (fuse_optimizer(module, torch.optim.AdamW, **ADAMW) if fused
                    else torch.optim.AdamW(module.parameters(), **ADAMW))
        self.peak = self.fwd_bwd = 0
        self.seconds: list[float] = []

    def step(self, kw: dict) -> float:
        start = time.perf_counter()
        out = self.module(**kw)
        out["loss"].backward()
        self.opt.step()
        self.opt.zero_grad()
        del out
        return time.perf_counter() - start

    def measure(self, kw: dict) -> None:
        """Step 1 (creates the optimizer state), then step 2 under exact storage tracking."""
        self.step(kw)
        state = [dict(s) for s in getattr(self.opt, "state", {}).values()]
        alive = (list(self.module.parameters()), list(self.module.buffers()), kw,
                 [p.grad for p in self.module.parameters()], tensors_in(state))
        tracker = LiveStorageTracker()
        with tracker:
            self.step(kw)
        self.peak = storage_bytes(alive) + tracker.peak_bytes


def make_arm(name: str, model_name: str, args: argparse.Namespace, kw: dict) -> Arm:
    model = build(model_name, args)
    if name == "original":
        return Arm(name, model, False, "")
    if name == "hf_gc":
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        return Arm(name, model, False, "HF's recipe: one checkpoint per decoder layer")
    outputs = {"min": None, "min_chunked": "all"}.get(name, "loss")
    fused = name.endswith("_fused")
    started = time.perf_counter()
    planning = fuse_optimizer(model, torch.optim.AdamW, **ADAMW) if fused else None
    try:
        gm = optimize(model, (), example_kwargs=kw, memory_budget="min",
                      passes=pipeline(outputs), fused_optimizer=planning)
    finally:
        if planning is not None:
            planning.remove()
    records = {r.name: r for r in gm.fxopt_report.passes}
    notes = [f"optimize {time.perf_counter() - started:.0f} s, verified"]
    if "checkpoint" in records:
        notes.append(f"{len(records['checkpoint'].stats.get('regions', ()))} regions")
    if "chunked_loss" in records:
        sites = records["chunked_loss"].stats.get("sites", [])
        planned = records["checkpoint"].stats.get("loss_chunk_rows") if "checkpoint" in records \
            else None
        rows = (f"{planned} (planned)" if planned is not None
                else f"{sites[0]['chunk_rows']}" if sites else "")
        notes.append(f"chunk {rows} tokens; logits {sites[0]['logits']}"
                     if sites else f"chunked_loss: {records['chunked_loss'].stats['skipped']}")
    return Arm(name, gm, fused, "; ".join(notes))


def time_arms(arms: list[Arm], kw: dict, repeats: int, inner: int) -> dict[str, tuple]:
    for arm in arms:
        arm.step(kw)  # warm-up
    ratios: dict[str, list[float]] = {arm.name: [] for arm in arms}
    reference = "hf_gc" if any(a.name == "hf_gc" for a in arms) else arms[0].name
    for round_ in range(repeats):
        order = arms[round_ % len(arms):] + arms[:round_ % len(arms)]
        seconds: dict[str, list[float]] = {arm.name: [] for arm in arms}
        for _ in range(inner):
            for arm in order:
                taken = arm.step(kw)
                seconds[arm.name].append(taken)
                arm.seconds.append(taken)
        base = statistics.median(seconds[reference])
        for arm in arms:
            ratios[arm.name].append(statistics.median(seconds[arm.name]) / base)
    return {name: (statistics.median(r), min(r), max(r)) for name, r in ratios.items()}


def run_model(model_name: str, args: argparse.Namespace, out: TeeOutput) -> None:
    vocab = model_spec(model_name, args)[1]
    gen = torch.Generator().manual_seed(SEED)
    ids = torch.randint(0, vocab, (args.batch, args.seq), generator=gen)
    kw = {"input_ids": ids, "labels": ids}
    arms = []
    for name in args.arms:
        arm = make_arm(name, model_name, args, kw)
        arm.measure(kw)
        if not arm.fused:
            arm.fwd_bwd = measure_train_step(arm.module, (), example_kwargs=kw).peak_bytes
        arms.append(arm)
    params = sum(p.numel() for p in arms[0].module.parameters())
    out(f"\n## {model_name}: vocab {vocab}, hidden {args.hidden}, {args.layers} layers, seq "
        f"{args.seq}, batch {args.batch}, float32; {params:,} parameters; AdamW")
    times = time_arms(arms, kw, args.repeats, args.inner)
    hf = next((a for a in arms if a.name == "hf_gc"), arms[0])
    out(f"{'arm':<24}{'step MiB':>9}{'x HF':>7}{'fwd+bwd MiB':>12}{'time x HF':>10}"
        f"{'spread':>12}{'median s':>9}  note")
    for arm in arms:
        ratio, low, high = times[arm.name]
        fwd_bwd = f"{arm.fwd_bwd / MiB:.1f}" if arm.fwd_bwd else "-"
        out(f"{arm.name:<24}{arm.peak / MiB:>9.1f}{arm.peak / hf.peak:>7.2f}{fwd_bwd:>12}"
            f"{ratio:>10.3f}{f'{low:.2f}-{high:.2f}':>12}"
            f"{statistics.median(arm.seconds):>9.2f}  {arm.note}")
    for arm in arms:
        if arm.fused:
            arm.opt.remove()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--models", default="llama,llama:128256,gpt2,qwen2")
    parser.add_argument("--vocab", type=int, default=None)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--seq", type=int, default=512)
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--inner", type=int, default=1)
    parser.add_argument("--arms", default=",".join(ARMS))
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)
    args.arms = [a for a in args.arms.split(",") if a]
    unknown = set(args.arms) - set(ARMS)
    if unknown:
        raise SystemExit(f"unknown arms {sorted(unknown)}: choose from {', '.join(ARMS)}")
    torch.set_num_threads(args.threads)
    out = TeeOutput(args.out)
    import transformers

    for line in header(__file__, device_name("cpu"), f"transformers {transformers.__version__}"):
        out(line)
    for model_name in args.models.split(","):
        started = time.perf_counter()
        run_model(model_name, args, out)
        out(f"  ({model_name}: {time.perf_counter() - started:.0f} s)")


if __name__ == "__main__":
    main()
