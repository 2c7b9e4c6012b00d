"""Language models: the loss off the peak. Whole training-step peak and step time, per arm.

    python benchmarks/lm_memory.py [--models llama,llama:128256,gpt2,qwen2] [--vocab N]
        [--hidden 256] [--layers 4] [--seq 512] [--batch 2] [--threads 1] [--repeats 5]
        [--inner 1] [--arms original,hf_gc,...] [--out FILE]
    python benchmarks/lm_memory.py --device cuda --dtype bfloat16 --config llama-1b
        [--layers 8] [--seq 2048] [--batch 2] [--steps 5] [--static-shapes] [--out FILE]

Causal language models built from configs with random weights (no download), called as Hugging
Face models are, ``model(input_ids=ids, labels=ids)`` (the loss is computed in forward, the
logits are returned too). ``llama``: ``LlamaForCausalLM`` (intermediate size 4 x hidden, 4
heads, 4 key/value heads; vocab 32,000 by default); ``gpt2``: ``GPT2LMHeadModel`` (tied
input/output embeddings; vocab 50,257); ``qwen2``: ``Qwen2ForCausalLM`` (vocab 151,936).
``name:N`` takes vocab N for that model (``llama:128256``: Llama 3's vocabulary); the default runs
the four configurations of issue 24, Llama at 32,000 and 128,256, GPT-2 and Qwen2. ``--vocab``
overrides the vocabulary of every model. ``--config llama-1b``: a Llama-3.2-1B-width model
(hidden 2048, intermediate 8192, 32 heads / 8 key-value heads, vocab 128,256, tied embeddings;
``--layers`` of them, 8 by default), the GPU table of issue 36.

Arms, each on its own model built from the same seed, trained with AdamW (``fused=True`` on a
GPU):

- ``original``: the model as built;
- ``hf_gc``: ``gradient_checkpointing_enable(use_reentrant=False)``, Hugging Face's recipe;
- ``hf_gc_liger``: the same with Liger-Kernel's fused linear cross-entropy computing the loss
  from the last hidden states (by hand: the logits are never built), when ``liger_kernel``
  imports (a GPU only: its kernels are Triton);
- ``min``: ``fxopt.optimize(model, (), example_kwargs=kw, memory_budget="min")``, the default:
  faithful (the logits are returned; the chunked loss joins the plan);
- ``min_plain``: ``"min"`` without the chunked loss (checkpointing alone);
- ``min_loss``: ``optimize(..., outputs="loss")``: for loops that read only the loss, the
  logits the model returns are never built in a training step;
- ``min_loss_fused``: the previous, planned and run with fxopt's fused AdamW step
  (``fxopt.fuse_optimizer``: each parameter updated, and its gradient freed, during backward).

Every fxopt arm is verified by ``optimize`` (loss, every gradient, the outputs). Each trains at
one shape, so ``--static-shapes`` optimizes them with ``dynamic=False`` (two static torch.export
traces instead of three symbolic ones: the same graph at that shape, captured faster), as a user
of such a loop would. Columns:

- ``step MiB``: the whole training-step peak: on CPU at step 2 (AdamW's moments exist since step
  1), parameters, buffers, inputs, optimizer state and gradients alive when the step starts,
  plus every tensor storage allocated during forward, ``loss.backward()``, ``optimizer.step()``
  and ``zero_grad()``, counted exactly (``fxopt.analysis.memtrack.LiveStorageTracker``); on a GPU
  ``torch.cuda.max_memory_allocated`` over steps 1..``--steps`` (the caching allocator's peak).
  The step's output (loss and logits) is kept until the step ends, as a training loop's ``out``
  is;
- ``x HF``: this arm's peak over HF checkpointing's; ``held MiB`` (GPU): allocated between
  steps (weights and optimizer state);
- ``fwd+bwd MiB`` (CPU): ``fxopt.measure_train_step`` (forward and backward, no optimizer);
- ``time x HF``: step time (forward, backward, optimizer step) over HF checkpointing's: on CPU
  ``--repeats`` rounds, each running ``--inner`` steps of every arm in an order rotated each
  round, per round the ratio of medians, the median ratio and the min-max over rounds; on a GPU
  each arm's median over its steps (CUDA-synchronized), with the spread over them.
  ``median s``: the arm's median step time.
- ``loss diff`` (GPU): the largest |loss - original's loss| over the steps (same weights, same
  batches).
"""

from __future__ import annotations

import argparse
import copy
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
GiB = 2**30
SEED = 0
VOCABS = {"llama": 32000, "gpt2": 50257, "qwen2": 151936}
ARMS = ("original", "hf_gc", "hf_gc_liger", "min", "min_plain", "min_loss", "min_loss_fused")
CPU_ARMS = ("original", "hf_gc", "min", "min_plain", "min_loss", "min_loss_fused")
GPU_ARMS = ("original", "hf_gc", "hf_gc_liger", "min", "min_loss", "min_loss_fused")
ADAMW = {"lr": 1e-4, "weight_decay": 1e-2}


def adamw_options(device: str) -> dict:
    """AdamW's arguments for every arm: ``fused=True`` on a GPU (the issue's setup)."""
    return {**ADAMW, **({"fused": True} if device == "cuda" else {})}


LLAMA_1B = dict(hidden_size=2048, intermediate_size=8192, num_attention_heads=32,
                num_key_value_heads=8, vocab_size=128256, tie_word_embeddings=True)


def model_spec(spec: str, args: argparse.Namespace) -> tuple[str, int]:
    """``"llama:128256"`` -> ("llama", 128256); without ``:N``, ``--vocab`` or the model's own."""
    name, _, vocab = spec.partition(":")
    if name not in VOCABS:
        raise SystemExit(f"unknown model {name!r}: choose from {', '.join(VOCABS)}")
    if args.config == "llama-1b":
        return name, LLAMA_1B["vocab_size"]
    return name, int(vocab) if vocab else (args.vocab or VOCABS[name])


_BUILT: dict[tuple, nn.Module] = {}


def build(spec: str, args: argparse.Namespace) -> nn.Module:
    """A copy of the model ``spec`` names, on ``args.device`` in ``args.dtype``: each arm gets
    its own, from the same seed (initialised once: a 749 M-parameter Llama takes seconds)."""
    key = (spec, args.config, args.layers, args.hidden, args.seq, args.vocab)
    if key not in _BUILT:
        _BUILT.clear()
        _BUILT[key] = initialised(spec, args)
    return copy.deepcopy(_BUILT[key]).to(device=args.device, dtype=args.dtype).train()


def initialised(spec: str, args: argparse.Namespace) -> nn.Module:
    import transformers

    torch.manual_seed(SEED)
    name, vocab = model_spec(spec, args)
    if args.config == "llama-1b":
        config = transformers.LlamaConfig(num_hidden_layers=args.layers,
                                          max_position_embeddings=args.seq, use_cache=False,
                                          **LLAMA_1B)
        model = transformers.LlamaForCausalLM(config)
    elif name == "llama":
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
    else:
        config = transformers.Qwen2Config(
            num_hidden_layers=args.layers, hidden_size=args.hidden,
            intermediate_size=4 * args.hidden, num_attention_heads=4, num_key_value_heads=4,
            max_position_embeddings=args.seq, vocab_size=vocab, use_cache=False,
            tie_word_embeddings=False)
        model = transformers.Qwen2ForCausalLM(config)
    return model


def pipeline_without_the_loss() -> list:
    """The default passes without chunked_loss (checkpointing alone under a budget)."""
    return [spec.name for spec in passes.REGISTRY if spec.default]


def liger_loss():
    """Liger-Kernel's fused linear cross-entropy module, or None where it does not import."""
    try:
        from liger_kernel.transformers import LigerFusedLinearCrossEntropyLoss
    except Exception:  # noqa: BLE001 -- absent, or no Triton/GPU: the arm is left out
        return None
    return LigerFusedLinearCrossEntropyLoss()


class Arm:
    """One arm: its module, its optimizer (ordinary or fused AdamW), how it computes the loss,
    figures."""

    def __init__(self, name: str, module: nn.Module, fused: bool, note: str, device: str,
                 loss_fn=None):
        self.name, self.module, self.fused, self.note = name, module, fused, note
        self.loss_fn = loss_fn
        adamw = adamw_options(device)
        self.opt = (fuse_optimizer(module, torch.optim.AdamW, **adamw) if fused
                    else torch.optim.AdamW(module.parameters(), **adamw))
        self.peak = self.fwd_bwd = self.held = 0
        self.seconds: list[float] = []
        self.losses: list[float] = []

    def loss(self, kw: dict) -> tuple[torch.Tensor, object]:
        if self.loss_fn is None:
            out = self.module(**kw)
            return out["loss"], out
        hidden = self.module.model(input_ids=kw["input_ids"]).last_hidden_state
        labels = kw["labels"]
        size = hidden.shape[-1]
        loss = self.loss_fn(self.module.lm_head.weight, hidden[:, :-1].reshape(-1, size),
                            labels[:, 1:].reshape(-1))
        return (loss[0] if isinstance(loss, tuple) else loss), hidden

    def step(self, kw: dict, sync: bool = False) -> float:
        if sync:
            torch.cuda.synchronize()
        start = time.perf_counter()
        loss, out = self.loss(kw)
        loss.backward()
        self.opt.step()
        self.opt.zero_grad()
        self.losses.append(float(loss.detach()) if not sync else loss.detach())
        del out, loss
        if sync:
            torch.cuda.synchronize()
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

    def run_on_gpu(self, kw: dict, steps: int) -> None:
        """Step 0 (optimizer state, kernels' first use), then ``steps`` steps: the caching
        allocator's peak over them, each one's time, the bytes held between steps."""
        self.step(kw, sync=True)
        torch.cuda.reset_peak_memory_stats()
        self.seconds = [self.step(kw, sync=True) for _ in range(steps)]
        self.peak = torch.cuda.max_memory_allocated()
        self.held = torch.cuda.memory_allocated()
        self.losses = [float(v) for v in self.losses]

    def release(self) -> None:
        if self.fused:
            self.opt.remove()
        self.module = self.opt = None


def make_arm(name: str, model_name: str, args: argparse.Namespace, kw: dict) -> Arm | None:
    model = build(model_name, args)
    if name == "original":
        return Arm(name, model, False, "", args.device)
    if name in ("hf_gc", "hf_gc_liger"):
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        if name == "hf_gc":
            return Arm(name, model, False, "HF's recipe: one checkpoint per decoder layer",
                       args.device)
        loss_fn = liger_loss() if args.device == "cuda" else None
        if loss_fn is None:
            return None
        return Arm(name, model, False, "HF checkpointing + Liger fused linear cross-entropy",
                   args.device, loss_fn)
    fused = name.endswith("_fused")
    started = time.perf_counter()
    # planned with the very optimizer the arm trains with: the fused kernel has no temporaries
    planning = (fuse_optimizer(model, torch.optim.AdamW, **adamw_options(args.device))
                if fused else None)
    options = {"outputs": "loss"} if name.startswith("min_loss") else {}
    if name == "min_plain":
        options["passes"] = pipeline_without_the_loss()
    try:
        gm = optimize(model, (), example_kwargs=kw, memory_budget="min",
                      fused_optimizer=planning, dynamic=not args.static_shapes, **options)
    finally:
        if planning is not None:
            planning.remove()
    report = gm.fxopt_report
    records = {r.name: r for r in report.passes}
    notes = [f"optimize {time.perf_counter() - started:.0f} s"
             f"{' (static shapes)' if args.static_shapes else ''}, verified at "
             f"{report.verified_where}"]
    if "checkpoint" in records:
        checkpoint = records["checkpoint"].stats
        notes.append(f"{len(checkpoint.get('regions', ()))} regions")
        if "loss_chunk_rows" in checkpoint:
            notes.append(f"loss chunks of {checkpoint['loss_chunk_rows']} tokens")
    if "chunked_loss" in records:
        sites = records["chunked_loss"].stats.get("sites", [])
        notes.append(f"logits {sites[0]['logits']}" if sites
                     else f"chunked_loss: {records['chunked_loss'].stats.get('skipped')}")
    return Arm(name, gm, fused, "; ".join(notes), args.device)


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


def batch(model_name: str, args: argparse.Namespace) -> dict:
    vocab = model_spec(model_name, args)[1]
    gen = torch.Generator().manual_seed(SEED)
    ids = torch.randint(0, vocab, (args.batch, args.seq), generator=gen).to(args.device)
    return {"input_ids": ids, "labels": ids}


def describe(model_name: str, args: argparse.Namespace, params: int) -> str:
    vocab = model_spec(model_name, args)[1]
    width = (f"hidden {LLAMA_1B['hidden_size']} (Llama-3.2-1B width)" if args.config == "llama-1b"
             else f"hidden {args.hidden}")
    return (f"\n## {model_name}: vocab {vocab}, {width}, {args.layers} layers, seq {args.seq}, "
            f"batch {args.batch}, {str(args.dtype).removeprefix('torch.')} on {args.device}; "
            f"{params:,} parameters; AdamW")


def run_model(model_name: str, args: argparse.Namespace, out: TeeOutput) -> None:
    kw = batch(model_name, args)
    arms = []
    for name in args.arms:
        arm = make_arm(name, model_name, args, kw)
        if arm is None:
            out(f"  ({name}: left out: liger_kernel does not import here)")
            continue
        arm.measure(kw)
        if not arm.fused and arm.loss_fn is None:
            arm.fwd_bwd = measure_train_step(arm.module, (), example_kwargs=kw).peak_bytes
        arms.append(arm)
    out(describe(model_name, args, sum(p.numel() for p in arms[0].module.parameters())))
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
        arm.release()


def run_model_on_gpu(model_name: str, args: argparse.Namespace, out: TeeOutput) -> None:
    """One arm at a time on the GPU (each arm's model alone in memory), the same batch."""
    kw = batch(model_name, args)
    done: list[Arm] = []
    params = 0
    for name in args.arms:
        torch.cuda.empty_cache()
        arm = make_arm(name, model_name, args, kw)
        if arm is None:
            out(f"  ({name}: left out: liger_kernel does not import here)")
            continue
        params = params or sum(p.numel() for p in arm.module.parameters())
        arm.run_on_gpu(kw, args.steps)
        arm.release()
        done.append(arm)
        out(f"  ({name}: peak {arm.peak / GiB:.2f} GiB, median step "
            f"{statistics.median(arm.seconds) * 1e3:.1f} ms)")
    out(describe(model_name, args, params))
    hf = next((a for a in done if a.name == "hf_gc"), done[0])
    original = next((a for a in done if a.name == "original"), None)
    out(f"{'arm':<18}{'peak GiB':>9}{'x HF':>7}{'held GiB':>9}{'step ms':>9}{'x HF':>7}"
        f"{'spread ms':>15}{'loss diff':>11}  note")
    hf_ms = statistics.median(hf.seconds) * 1e3
    for arm in done:
        ms = statistics.median(arm.seconds) * 1e3
        diff = (max(abs(a - b) for a, b in zip(arm.losses, original.losses))
                if original is not None else float("nan"))
        spread = f"{min(arm.seconds) * 1e3:.1f}-{max(arm.seconds) * 1e3:.1f}"
        out(f"{arm.name:<18}{arm.peak / GiB:>9.2f}{arm.peak / hf.peak:>7.2f}"
            f"{arm.held / GiB:>9.2f}{ms:>9.1f}{ms / hf_ms:>7.2f}{spread:>15}{diff:>11.2e}  "
            f"{arm.note}")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--models", default=None)
    parser.add_argument("--config", choices=("small", "llama-1b"), default="small")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", choices=("float32", "bfloat16"), default=None)
    parser.add_argument("--vocab", type=int, default=None)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--layers", type=int, default=None)
    parser.add_argument("--seq", type=int, default=None)
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--inner", type=int, default=1)
    parser.add_argument("--steps", type=int, default=5, help="GPU: measured steps per arm")
    parser.add_argument("--arms", default=None)
    parser.add_argument("--static-shapes", action="store_true",
                        help="optimize the fxopt arms with dynamic=False (one shape is trained)")
    parser.add_argument("--out", default=None)
    return parser


def parse(argv: list[str] | None) -> argparse.Namespace:
    """The arguments, with the defaults of the device and config filled in."""
    args = build_parser().parse_args(argv)
    gpu = torch.device(args.device).type == "cuda"
    large = args.config == "llama-1b"
    args.models = args.models or ("llama" if large else "llama,llama:128256,gpt2,qwen2")
    args.dtype = getattr(torch, args.dtype or ("bfloat16" if gpu else "float32"))
    args.layers = args.layers or (8 if large else 4)
    args.seq = args.seq or (2048 if large else 512)
    args.arms = [a for a in (args.arms or ",".join(GPU_ARMS if gpu else CPU_ARMS)).split(",")
                 if a]
    unknown = set(args.arms) - set(ARMS)
    if unknown:
        raise SystemExit(f"unknown arms {sorted(unknown)}: choose from {', '.join(ARMS)}")
    if gpu and not torch.cuda.is_available():
        raise SystemExit("--device cuda: no CUDA device here")
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse(argv)
    torch.set_num_threads(args.threads)
    out = TeeOutput(args.out)
    import transformers

    for line in header(__file__, device_name(args.device),
                       f"transformers {transformers.__version__}"):
        out(line)
    run = run_model_on_gpu if torch.device(args.device).type == "cuda" else run_model
    for model_name in args.models.split(","):
        started = time.perf_counter()
        run(model_name, args, out)
        out(f"  ({model_name}: {time.perf_counter() - started:.0f} s)")


if __name__ == "__main__":
    main()
