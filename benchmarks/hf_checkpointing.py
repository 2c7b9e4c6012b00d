"""Hugging Face transformers: fxopt's checkpointing vs HF's own, torch.compile's min-cut, none.

    python benchmarks/hf_checkpointing.py [--models gpt2,llama] [--layers 6] [--hidden 128]
        [--seq 256] [--batch 4] [--vocab 1000] [--budgets 0.8,0.6,0.4,0.3,0.2,min]
        [--repeats 5] [--threads 1] [--peers / --no-peers] [--out FILE] [--device cpu | cuda]

Small causal language models built from configs with random weights (no download), on
``--device`` (default cpu; on cuda every peak is the caching allocator's, and the
``torch_compile_min_cut`` peer compiles with Inductor):
``GPT2LMHeadModel`` and ``LlamaForCausalLM`` with ``--layers`` layers of width ``--hidden``,
4 heads (Llama: intermediate size 344, 4 key/value heads), ``use_cache=False``, the configs'
default dropout (GPT-2: 0.1 on embeddings, attention and residuals; Llama: none), in train mode.
Each model is called as Hugging Face models are, ``model(input_ids=ids, labels=ids)``: the loss
is computed inside forward. Rows, per model, all measured in this one process:

- ``original``: the model as built;
- ``hf_gradient_checkpointing``: a second model built from the same seed (the first is never
  modified), then ``gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant":
  False})``: one checkpoint per decoder layer, HF's own recipe;
- ``fxopt``: ``fxopt.optimize(model, (), example_kwargs=kw, memory_budget=B)`` for each budget B,
  all from one capture (``fxopt.capture_model``; each row's note gives its seconds apart)
  (a fraction of the unoptimized activation memory, see ``fxopt.planning.budget``; ``min``,
  passed as ``memory_budget="min"``, is the least-memory plan the pass finds). A ``BudgetError``
  is printed as ``infeasible``: that fraction is below what the pass can reach;
- ``torch_compile_min_cut`` (``fxopt.bench.peers``) at the same fractions, on a wrapper module
  ``forward(input_ids, labels)`` around the same model object (the peers take positional tensors);
- ``checkpoint_sequential``: one line saying why it does not apply.

Columns:

- ``peak MiB``: whole training-step peak (parameters, buffers, inputs, live gradients,
  activations) = the baseline (parameters + buffers + inputs) + the allocator-level peak of one
  training step above it (``fxopt.bench.runs.step_peak_bytes``: ``torch.profiler`` allocation
  events on CPU). One method for every row, because exact storage tracking cannot see inside a
  compiled graph; ``mem x``: the original's peak over this one;
- ``exact MiB``: the same peak by ``fxopt.measure_train_step`` (exact live-storage tracking),
  for the eager rows only; ``act MiB``: allocator-level step peak minus the parameter gradients
  (as ``checkpoint_sweep.py`` defines it);
- ``time x``: step time over the original's: ``--repeats`` samples, each the ratio of the medians
  of one ``fxopt.measure.timing.timed_against`` call (two rounds of training steps, original and
  candidate alternating, both orders); the median of the samples and their min-max. The
  ``original`` row's spread is its noise floor: a third, identical model timed against it;
- ``equal``: ``fxopt.verify`` against the original (outputs, parameter gradients, with dropout
  active and the same seed); fxopt verifies in ``optimize`` itself.

A verdict per model: fxopt's least-memory point against HF's checkpointing (peak and time), and
the fastest fxopt point whose peak is at most HF's.
"""

from __future__ import annotations

import argparse
import datetime
import os
import shlex
import statistics
import sys
import time
import warnings
from dataclasses import dataclass

import torch
import transformers
from torch import nn

from fxopt.api import optimize
from fxopt.capture.reuse import capture_model
from fxopt.bench.environment import TeeOutput, device_name
from fxopt.bench.peers import build_peer
from fxopt.bench.runs import step_peak_bytes
from fxopt.core.errors import BudgetError, FxoptError
from fxopt.core.inputs import bind_keywords
from fxopt.measure.peaks import measure_train_step
from fxopt.measure.timing import timed_against
from fxopt.planning.budget import budget_fraction, trainable_grad_bytes
from fxopt.verify.equivalence import verify

MiB = 2**20
SEED = 0


def build(name: str, args) -> nn.Module:
    """A fresh model with weights drawn from SEED: every call gives an identical model."""
    torch.manual_seed(SEED)
    if name == "gpt2":
        config = transformers.GPT2Config(
            n_layer=args.layers, n_embd=args.hidden, n_head=4, n_positions=args.seq,
            vocab_size=args.vocab, use_cache=False)
        model = transformers.GPT2LMHeadModel(config)
        # GPT2LMHeadModel's name names no loss, so every forward logs a warning (once) and takes
        # ForCausalLM's loss; saying so up front computes the same loss without the logging
        # call, which would otherwise break torch.compile's graph in two.
        model.loss_type = "ForCausalLM"
    elif name == "llama":
        config = transformers.LlamaConfig(
            num_hidden_layers=args.layers, hidden_size=args.hidden,
            intermediate_size=344 if args.hidden == 128 else 4 * args.hidden,
            num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=args.seq,
            vocab_size=args.vocab, use_cache=False)
        model = transformers.LlamaForCausalLM(config)
    else:
        raise SystemExit(f"unknown model {name!r}: choose from gpt2, llama")
    return model.to(args.device).train()


class KeywordCall(nn.Module):
    """``forward(input_ids, labels)`` calling ``model(input_ids=..., labels=...)``: the peers
    take positional tensors, Hugging Face models keyword ones."""

    def __init__(self, model: nn.Module):
        super().__init__()
        self.model = model

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor):
        return self.model(input_ids=input_ids, labels=labels)


@dataclass
class Row:
    method: str
    budget: str
    peak: int | None          # whole-step peak, allocator level, baseline included
    exact: int | None         # measure_train_step().peak_bytes (eager rows)
    act: int | None
    time_x: float | None
    spread: tuple[float, float] | None
    equal: str
    note: str


def time_ratio(original: nn.Module, variant: nn.Module, inputs: tuple, repeats: int
               ) -> tuple[float, tuple[float, float]]:
    """Median and (min, max) of ``repeats`` samples of variant/original step time."""
    ratios = []
    for _ in range(repeats):
        seconds, base = timed_against(original, variant, inputs, 2, min_seconds=0.0,
                                      max_repeats=2)
        ratios.append(seconds / base)
    return statistics.median(ratios), (min(ratios), max(ratios))


def equality(reference: nn.Module, candidate: nn.Module, inputs: tuple) -> tuple[str, str]:
    try:
        report = verify(reference, candidate, inputs)
    except FxoptError as error:
        return "NO", str(error).splitlines()[0]
    if report.ok:
        return "yes", ""
    worst = report.worst()[0]
    return "NO", f"differs: {worst.kind} {worst.name} (max abs {worst.max_abs_diff:.2g})"


def dynamo_counts() -> tuple[int, int]:
    from torch._dynamo.utils import counters
    return (counters["stats"]["unique_graphs"], sum(counters["graph_break"].values()))


def run_model(name: str, args, out: TeeOutput, failures: list[str]) -> list[Row]:
    model = build(name, args)
    ids = torch.randint(0, args.vocab, (args.batch, args.seq),
                        generator=torch.Generator().manual_seed(SEED)).to(args.device)
    kw = {"input_ids": ids, "labels": ids}
    inputs = bind_keywords(model, (), kw)  # forward's positional arguments: one call for all rows
    exact = measure_train_step(model, (), example_kwargs=kw)
    baseline, grads = exact.baseline_bytes, trainable_grad_bytes(model)
    original_step = step_peak_bytes(model, inputs)
    original_peak = baseline + original_step
    activations = original_step - grads
    out(f"\n## {name}: {type(model).__name__}, {args.layers} layers, hidden {args.hidden}, "
        f"seq {args.seq}, batch {args.batch}, vocab {args.vocab}, attention "
        f"{model.config._attn_implementation}; {sum(p.numel() for p in model.parameters()):,} "
        f"parameters")
    out(f"original peak {original_peak / MiB:.1f} MiB = baseline {baseline / MiB:.1f} + "
        f"parameter grads {grads / MiB:.1f} + activations {activations / MiB:.1f} (allocator); "
        f"exact: {exact.peak_bytes / MiB:.1f} MiB, of which activations at the peak "
        f"{exact.activations_at_peak_bytes / MiB:.1f}")
    out(f"{'model':<7}{'method':<27}{'budget':>7}{'peak MiB':>9}{'mem x':>7}{'exact MiB':>10}"
        f"{'act MiB':>9}{'time x':>8}{'spread':>13}  {'equal':<6}note")
    rows: list[Row] = []

    def report(row: Row) -> None:
        rows.append(row)
        def fmt(b: int | None) -> str:
            return f"{b / MiB:.1f}" if b is not None else "-"

        mem_x = f"{original_peak / row.peak:.2f}" if row.peak else "-"
        time_x = f"{row.time_x:.3f}" if row.time_x is not None else "-"
        spread = f"{row.spread[0]:.2f}-{row.spread[1]:.2f}" if row.spread else "-"
        out(f"{name:<7}{row.method:<27}{row.budget:>7}{fmt(row.peak):>9}{mem_x:>7}"
            f"{fmt(row.exact):>10}{fmt(row.act):>9}{time_x:>8}{spread:>13}  {row.equal:<6}"
            f"{row.note}")

    def skip(method: str, budget: str, why: str) -> None:
        out(f"{name:<7}{method:<27}{budget:>7}  {why}")

    # original; its time spread is the noise floor: an identical third model timed against it
    twin = build(name, args)
    ratio, spread = time_ratio(model, twin, inputs, args.repeats)
    report(Row("original", "-", original_peak, exact.peak_bytes, activations, 1.0, spread, "yes",
               f"identical copy timed against it: x{ratio:.3f} (noise floor)"))
    del twin

    # Hugging Face's own gradient checkpointing, on a second model built from the same seed
    hf = build(name, args)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)  # "use activation_checkpointing_enable"
        hf.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    equal, why = equality(model, hf, inputs)
    hf_step = step_peak_bytes(hf, inputs)
    ratio, spread = time_ratio(model, hf, inputs, args.repeats)
    report(Row("hf_gradient_checkpointing", "-", baseline + hf_step,
               measure_train_step(hf, (), example_kwargs=kw).peak_bytes, hf_step - grads, ratio,
               spread, equal, "; ".join(filter(None, [
                   "HF's own recipe (one checkpoint per layer, use_reentrant=False)", why]))))
    del hf

    # fxopt at each budget, and its least-memory plan, from one capture
    fractions = args.budgets.split(",")
    started = time.perf_counter()
    captured = capture_model(model, (), example_kwargs=kw)
    capture_seconds = time.perf_counter() - started
    for fraction in fractions:
        started = time.perf_counter()
        try:
            gm = optimize(model, (), example_kwargs=kw, captured=captured,
                          memory_budget="min" if fraction == "min" else float(fraction))
        except FxoptError as error:
            message = str(error).splitlines()[0]
            failures.append(f"{name} fxopt@{fraction}: {type(error).__name__}: {message}")
            skip("fxopt", fraction, f"{'infeasible' if isinstance(error, BudgetError) else 'failed'}"
                 f" ({type(error).__name__}): {message}")
            continue
        seconds = time.perf_counter() - started
        stats = next((r.stats for r in gm.fxopt_report.passes if r.name == "checkpoint"), {})
        regions = stats.get("regions", [])
        selective = sum(1 for r in regions if r.mode == "selective")
        light = sum(1 for r in regions if r.mode == "light")
        kinds = f"{selective} selective" + (f", {light} light" if light else "")
        note = (f"{len(regions)} regions ({kinds}), predicted "
                f"{stats.get('predicted_after', 0) / MiB:.1f} MiB, optimize {seconds:.0f} s "
                f"from a capture of {capture_seconds:.0f} s made once")
        gm_step = step_peak_bytes(gm, inputs)
        ratio, spread = time_ratio(model, gm, inputs, args.repeats)
        if fraction == "min" and stats.get("predicted_after"):
            before, after = stats["predicted_before"], int(stats["predicted_after"])
            reach = budget_fraction(after, peak=before, activations=before - baseline - grads)
            note = f"reaches fraction {reach:.3f}; {note}"
        report(Row("fxopt", fraction, baseline + gm_step,
                   measure_train_step(gm, (), example_kwargs=kw).peak_bytes, gm_step - grads,
                   ratio, spread, "yes" if gm.fxopt_report.verification.ok else "NO", note))
        del gm

    # peers, on a keyword-calling wrapper around the same model object
    if not args.peers:
        return rows
    wrapper = KeywordCall(model)
    peer_inputs = (ids, ids)
    variant, why = build_peer("checkpoint_sequential", wrapper, peer_inputs, 1.0)
    skip("checkpoint_sequential", "-",
         "not applicable: " + (why if variant is None else "built, but not measured") +
         " (an HF model is no chain of single-tensor stages: input_ids and labels in, "
         "a ModelOutput of loss and logits out)")
    for fraction in (f for f in fractions if f != "min"):
        torch._dynamo.reset()  # each budget compiles from scratch, within the recompile limit
        graphs, breaks = dynamo_counts()
        started = time.perf_counter()
        try:
            variant, note = build_peer("torch_compile_min_cut", wrapper, peer_inputs,
                                       float(fraction))
            peer_step = step_peak_bytes(variant, peer_inputs)  # warm-up compiles
        except Exception as error:  # noqa: BLE001 -- a peer that fails is a row, not a crash
            message = str(error).splitlines()[0] if str(error) else ""
            failures.append(f"{name} torch_compile_min_cut@{fraction}: "
                            f"{type(error).__name__}: {message}")
            skip("torch_compile_min_cut", fraction, f"failed ({type(error).__name__}): {message}")
            continue
        seconds = time.perf_counter() - started
        graphs_after, breaks_after = dynamo_counts()
        equal, why = equality(wrapper, variant, peer_inputs)
        ratio, spread = time_ratio(wrapper, variant, peer_inputs, args.repeats)
        note = (f"{note.split(', ')[0]}; {graphs_after - graphs} graph(s), "
                f"{breaks_after - breaks} break(s), compile+step {seconds:.0f} s")
        report(Row("torch_compile_min_cut", fraction, baseline + peer_step, None,
                   peer_step - grads, ratio, spread, equal, "; ".join(filter(None, [note, why]))))
        del variant
    torch._dynamo.reset()
    return rows


def verdict(name: str, rows: list[Row], out: TeeOutput) -> None:
    hf = next((r for r in rows if r.method == "hf_gradient_checkpointing"), None)
    ours = [r for r in rows if r.method == "fxopt" and r.peak]
    if hf is None or not ours:
        out(f"  verdict {name}: nothing to compare")
        return
    least = min(ours, key=lambda r: r.peak)
    out(f"  verdict {name}: fxopt least-memory point (@{least.budget}) peak "
        f"{least.peak / MiB:.1f} MiB {'<=' if least.peak <= hf.peak else '>'} HF's "
        f"{hf.peak / MiB:.1f} MiB ({least.peak / hf.peak:.2f}x HF's peak; exact "
        f"{least.exact / MiB:.1f} vs {hf.exact / MiB:.1f}), at time x{least.time_x:.3f} vs HF's "
        f"x{hf.time_x:.3f} ({'faster' if least.time_x <= hf.time_x else 'slower'})")
    within = [r for r in ours if r.peak <= hf.peak]
    if within:
        fastest = min(within, key=lambda r: r.time_x)
        out(f"  at HF's memory: fastest fxopt point with peak <= {hf.peak / MiB:.1f} MiB is "
            f"@{fastest.budget}: {fastest.peak / MiB:.1f} MiB, time x{fastest.time_x:.3f} vs "
            f"HF's x{hf.time_x:.3f} ({'faster' if fastest.time_x <= hf.time_x else 'slower'})")
    else:
        out(f"  at HF's memory: no fxopt point reaches {hf.peak / MiB:.1f} MiB (closest "
            f"{least.peak / MiB:.1f} MiB)")
    peers = [r for r in rows if r.method == "torch_compile_min_cut" and r.peak]
    if peers:
        low = min(peers, key=lambda r: r.peak)
        out(f"  torch.compile min-cut least-memory point (@{low.budget}): {low.peak / MiB:.1f} MiB"
            f", time x{low.time_x:.3f}")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="gpt2,llama")
    parser.add_argument("--layers", type=int, default=6)
    parser.add_argument("--hidden", type=int, default=128)
    parser.add_argument("--seq", type=int, default=256)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--vocab", type=int, default=1000)
    parser.add_argument("--budgets", default="0.8,0.6,0.4,0.3,0.2,min",
                        help="comma-separated fractions of activation memory, and 'min' (the "
                             "least-memory plan); the peers run at the fractions")
    parser.add_argument("--repeats", type=int, default=5,
                        help="timing samples per row (each: two alternated rounds)")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--peers", action=argparse.BooleanOptionalAction, default=True)
    parser.add_argument("--out", help="also write the table to this file")
    parser.add_argument("--device", default="cpu", help="cpu or cuda")
    return parser


def main() -> int:
    args = build_parser().parse_args()
    args.device = torch.device(args.device)
    torch.set_num_threads(args.threads)
    transformers.logging.set_verbosity_error()
    out = TeeOutput(args.out)
    out(f"# benchmarks/hf_checkpointing.py -- {datetime.date.today().isoformat()}; device: "
        f"{device_name(args.device)}; torch {torch.__version__}; transformers "
        f"{transformers.__version__}; torch threads {torch.get_num_threads()} of "
        f"{os.cpu_count()} cores")
    out(f"# command: {shlex.join([sys.executable, *sys.argv])}")
    out("# peak MiB: whole training step (params + buffers + inputs + grads + activations), "
        "allocator level ("
        + ("the CUDA caching allocator" if args.device.type == "cuda"
           else "torch.profiler allocation events")
        + ", fxopt.bench.runs.step_peak_bytes) "
        "for every row; exact MiB: fxopt.measure_train_step (live-storage tracking, eager rows "
        "only); time x: median of --repeats samples vs the original, alternated, spread min-max")
    failures: list[str] = []
    for name in args.models.split(","):
        started = time.perf_counter()
        rows = run_model(name, args, out, failures)
        verdict(name, rows, out)
        out(f"  ({name}: {time.perf_counter() - started:.0f} s)")
    if failures:
        out("\nfailures:")
        for line in failures:
            out(f"  {line}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
