"""What keeping the model's blocks as calls costs the least-memory plan.

    python benchmarks/block_structure.py [--out FILE]

fxopt keeps each repeated block a submodule its graph calls (``fxopt.rewrite.blocks``), so
``fully_shard`` and ``torch.compile`` work per block; the price is that no checkpointed region
may span two blocks. This script plans ``memory_budget="min"`` twice per model, with regions kept
inside blocks (the default) and with ``checkpoint{regions_across_blocks=true}``, from the
roofline (``profile=False``: the same plans on every run), and measures one training step of
each on CPU (``fxopt.measure_train_step``: forward and backward, exact storage counting).

Columns: the measured step peak of each plan and their ratio (kept / across: above 1 is what the
structure costs), the plans' predicted extra recompute time, and the blocks kept as calls.
"""

from __future__ import annotations

import argparse
import datetime
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import fxopt  # noqa: E402
import fxopt.passes as builtin_passes  # noqa: E402
from fxopt.bench.environment import TeeOutput, code_commit  # noqa: E402

KiB = 1024


def _models():
    import torchvision
    import transformers

    from fxopt.models_zoo.transformer import TinyLanguageModel

    def hf(config_class, model_class, **config):
        def build():
            torch.manual_seed(0)
            model = model_class(config_class(**config))
            ids = torch.randint(0, config["vocab_size"], (2, 64),
                                generator=torch.Generator().manual_seed(1))
            return model, (), {"input_ids": ids, "labels": ids}
        return build

    def zoo_gpt():
        torch.manual_seed(0)
        model = TinyLanguageModel(vocab_size=1200, dim=64, heads=4, depth=4, max_seq_len=64)
        return model, (torch.randint(0, 1200, (2, 64)),), None

    def resnet(depth):
        def build():
            torch.manual_seed(0)
            model = getattr(torchvision.models, f"resnet{depth}")(num_classes=10)
            return model, (torch.randn(2, 3, 64, 64),), None
        return build

    return {
        "gpt (fx, zoo)": zoo_gpt,
        "GPT-2 (export)": hf(transformers.GPT2Config, transformers.GPT2LMHeadModel,
                             vocab_size=1200, n_embd=64, n_layer=4, n_head=4, n_positions=128,
                             use_cache=False),
        "Llama (export)": hf(transformers.LlamaConfig, transformers.LlamaForCausalLM,
                             vocab_size=1200, hidden_size=64, intermediate_size=256,
                             num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=4,
                             max_position_embeddings=128, use_cache=False),
        "resnet18 (fx)": resnet(18),
        "resnet50 (fx)": resnet(50),
    }


def _plan(build, across: bool):
    model, args, kwargs = build()
    requests = [(s.name, {"profile": False, "regions_across_blocks": across}
                 if s.name == "checkpoint" else {})
                for s in builtin_passes.REGISTRY
                if s.default or s.name in ("checkpoint", "chunked_loss")]
    slim = fxopt.optimize(model, args, example_kwargs=kwargs, memory_budget="min",
                          passes=requests)
    checkpoint = next(p for p in slim.fxopt_report.passes if p.name == "checkpoint")
    peak = fxopt.measure_train_step(slim, args, example_kwargs=kwargs).peak_bytes
    return peak, checkpoint.stats.get("predicted_extra_ms", 0.0), len(fxopt.blocks(slim))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    torch.set_num_threads(1)
    out = TeeOutput(args.out)
    out(f"# block structure vs the least-memory plan, CPU, 1 thread -- "
        f"{datetime.date.today().isoformat()}, torch {torch.__version__}, "
        f"commit {code_commit() or 'unknown'}")
    out(f"# command: python benchmarks/block_structure.py {' '.join(sys.argv[1:])}")
    out()
    out(f"{'model':<16} {'kept KiB':>9} {'across KiB':>11} {'kept/across':>12} "
        f"{'extra ms kept':>14} {'across':>7} {'blocks kept':>12}")
    for name, build in _models().items():
        kept, kept_ms, count = _plan(build, across=False)
        across, across_ms, _ = _plan(build, across=True)
        out(f"{name:<16} {kept / KiB:>9.1f} {across / KiB:>11.1f} {kept / across:>12.3f} "
            f"{kept_ms:>14.2f} {across_ms:>7.2f} {count:>12}")


if __name__ == "__main__":
    main()
