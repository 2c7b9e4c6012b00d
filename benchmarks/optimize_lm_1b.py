"""How long ``fxopt.optimize`` takes on issue 36's language model, without verification.

    python benchmarks/optimize_lm_1b.py [--layers 8] [--seq 2048] [--batch 2]
                                        [--budget min] [--static-shapes] [--out FILE]

The Llama-3.2-1B-width model of ``benchmarks/lm_memory.py`` (``LLAMA_1B``: hidden 2,048,
vocab 128,256, tied embeddings) in bfloat16, random-init, ``memory_budget="min"``, labels
given: the setup whose GPU goal is 15 s. ``verify=False``, since on a CPU the two training
steps verification runs take minutes at this size; ``benchmarks/optimize_speed.py`` measures
verification on smaller models. Prints the report's phases, the fake-tensor predictions and
each pass's time: what is left to cut. On a GPU add ``--device cuda``. ``--static-shapes``:
``dynamic=False``, two static torch.export traces instead of three symbolic ones, as
``benchmarks/cuda_suite.py`` runs ``lm_memory.py`` on this model.
"""

from __future__ import annotations

import argparse
import datetime
import sys
import time
from pathlib import Path

import torch

import fxopt
from fxopt.bench.environment import code_commit, device_name

sys.path.insert(0, str(Path(__file__).resolve().parent))
from lm_memory import LLAMA_1B  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--seq", type=int, default=2048)
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--budget", default="min")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--static-shapes", action="store_true")
    parser.add_argument("--out", default=None)
    options = parser.parse_args()
    import transformers
    torch.manual_seed(0)
    config = transformers.LlamaConfig(**{**LLAMA_1B, "num_hidden_layers": options.layers},
                                      max_position_embeddings=options.seq, use_cache=False)
    device = torch.device(options.device)
    with device:
        model = transformers.LlamaForCausalLM(config).to(torch.bfloat16)
    ids = torch.randint(0, config.vocab_size, (options.batch, options.seq), device=device)
    budget = options.budget if options.budget == "min" else float(options.budget)
    started = time.perf_counter()
    slim = fxopt.optimize(model, (), example_kwargs={"input_ids": ids, "labels": ids},
                          memory_budget=budget, verify=False,
                          dynamic=not options.static_shapes)
    total = time.perf_counter() - started
    report = slim.fxopt_report
    lines = [
        f"# benchmarks/optimize_lm_1b.py -- {datetime.date.today()}; device: "
        f"{device_name(device)}; torch {torch.__version__}; code: commit "
        f"{code_commit() or '(unknown)'}",
        f"# command: python benchmarks/{Path(__file__).name} {' '.join(sys.argv[1:])}",
        f"optimize {total:.2f} s; phases: "
        + ", ".join(f"{k} {v:.2f}" for k, v in report.seconds.items())
        + f"; fake runs: {report.predictions.get('run', 0)} "
          f"(+{report.predictions.get('remembered', 0)} from memory)",
        "passes: " + ", ".join(f"{p.name} {p.seconds:.2f}" for p in report.passes),
    ]
    text = "\n".join(lines)
    print(text)
    if options.out:
        with open(options.out, "a") as out:
            out.write(text + "\n")


if __name__ == "__main__":
    main()
