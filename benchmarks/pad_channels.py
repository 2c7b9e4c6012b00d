"""Channel padding: training-step time padded vs unpadded, side by side in one run.

    python benchmarks/pad_channels.py [--repeats 20] [--models odd_channel_cnn,transformer_lm]
                                      [--out FILE] [--device cpu | cuda]
                                      [--dtypes float16,bfloat16,float32]

On CUDA: ``odd_channel_cnn`` (batch 256, 3x32x32; channels 30/60/100) and ``transformer_lm``
(batch 16, 256 tokens; dim 100, 5 heads, vocab 50257) in float16 and bfloat16 (``--dtypes``:
add float32, where the default policy pads the convs that cuDNN runs in TF32, torch's default).
For each, the training step (forward + backward) of the traced original, of the default policy
(keeps only the pads it measured faster) and of every pad forced, each timed alternately against
the original (median of at least ``--repeats`` steps, ``fxopt.measure.timing.timed_against``);
ratio < 1 is faster.

On CPU: the default policy leaves each model unpadded (the pass's reason is printed), and the
forced padding's cost is timed the same way (smaller batches), in float32 unless ``--dtypes``
says otherwise (bfloat16 and float16 run on CPU too, slowly).

Every padded model is verified against the original first (``fxopt.optimize(verify=True)``).
Prints only; ``--out FILE`` also writes the table to FILE. ``--device`` defaults to CUDA when a
GPU is available, else the CPU.
"""

from __future__ import annotations

import argparse
import datetime
import sys

import torch

from fxopt import models_zoo
from fxopt.api import optimize
from fxopt.bench.environment import device_name
from fxopt.capture.trace import trace
from fxopt.core.errors import FxoptError
from fxopt.measure.timing import timed_against

CUDA_SIZES = {"odd_channel_cnn": (256, None), "transformer_lm": (16, 256)}
CPU_SIZES = {"odd_channel_cnn": (16, None), "transformer_lm": (2, 16)}


def example(name: str, device: torch.device, dtype: torch.dtype, sizes: dict) -> tuple:
    """The zoo model and inputs at the benchmark's size, on ``device`` in ``dtype``."""
    batch, tokens = sizes[name]
    model, inputs = models_zoo.build(name, batch)
    if tokens is not None:
        tokens_generator = torch.Generator().manual_seed(0)
        inputs = (torch.randint(0, 50257, (batch, tokens), generator=tokens_generator),)
    model = model.to(device, dtype)
    inputs = tuple(t.to(device, dtype) if t.is_floating_point() else t.to(device) for t in inputs)
    return model, inputs


def pad_summary(gm: torch.nn.Module) -> str:
    record = gm.fxopt_report.passes[0]
    if not record.modified:
        return f"unpadded: {record.stats.get('reason', '')}"
    stats = record.stats
    declined = len(stats.get("declined", {}))
    return (f"{stats['padded_ops']} ops padded (+{stats['extra_flops_pct']}% FLOPs), "
            f"{declined} declined")


def row(out: list[str], text: str) -> None:
    print(text, flush=True)
    out.append(text)


def compare(out: list[str], name: str, dtype: torch.dtype, device: torch.device,
            variants: list[tuple[str, str]], sizes: dict, repeats: int) -> None:
    model, inputs = example(name, device, dtype, sizes)
    original = trace(model, inputs)
    dtype_name = str(dtype).removeprefix("torch.")
    for label, passes in variants:
        try:
            padded = optimize(model, inputs, passes=passes)
        except FxoptError as error:
            row(out, f"{name:<16}{dtype_name:<10}{label:<18}failed: {error.what}")
            continue
        summary = pad_summary(padded)
        if not padded.fxopt_report.passes[0].modified:
            row(out, f"{name:<16}{dtype_name:<10}{label:<18}{'':>10}{'':>10}{'':>8}  {summary}")
            continue
        variant_s, original_s = timed_against(original, padded, inputs, repeats)
        row(out, f"{name:<16}{dtype_name:<10}{label:<18}{original_s * 1e3:>10.3f}"
                 f"{variant_s * 1e3:>10.3f}{variant_s / original_s:>8.3f}  {summary}")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--models", default="odd_channel_cnn,transformer_lm")
    parser.add_argument("--out", default=None, help="also write the table to this file")
    parser.add_argument("--device", default=None,
                        help="cpu or cuda (default: cuda when available, else cpu)")
    parser.add_argument("--dtypes", default=None,
                        help="comma-separated, e.g. float16,bfloat16,float32 (default: float16 "
                             "and bfloat16 on CUDA, float32 on CPU)")
    return parser


def main() -> int:
    args = build_parser().parse_args()
    if args.device is None:
        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    device = torch.device(args.device)
    cuda = device.type == "cuda"
    out: list[str] = []
    row(out, f"channel padding, training step; device: {device_name(device)}; torch "
             f"{torch.__version__}; {datetime.date.today().isoformat()}; "
             f"command: {' '.join(sys.argv)}")
    row(out, f"{'model':<16}{'dtype':<10}{'variant':<18}{'orig ms':>10}{'pad ms':>10}"
             f"{'ratio':>8}  what the pass did")
    variants = [("default policy", "pad"), ("forced", "pad{force=true}")]
    if args.dtypes:
        dtypes = tuple(getattr(torch, name.strip()) for name in args.dtypes.split(","))
    else:
        dtypes = (torch.float16, torch.bfloat16) if cuda else (torch.float32,)
    for name in args.models.split(","):
        for dtype in dtypes:
            compare(out, name, dtype, device, variants, CUDA_SIZES if cuda else CPU_SIZES,
                    args.repeats)
    if args.out:
        with open(args.out, "w") as handle:
            handle.write("\n".join(out) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
