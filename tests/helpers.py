"""check_pass(): the standard per-pass test, and a compact golden form of a graph."""

from __future__ import annotations

import os
import sys
from typing import Any

import torch
from torch import fx, nn
from torch.utils._python_dispatch import TorchDispatchMode

from fxopt.capture.chain import capture as capture_model
from fxopt.measure.peaks import measure_train_step
from fxopt.rewrite.invariants import graph_problems, snapshot
from fxopt.rewrite.pass_base import PassResult
from fxopt.verify.equivalence import verify


def _describe_target(gm: fx.GraphModule, node: fx.Node) -> str:
    if node.op == "call_module":
        module = gm.get_submodule(node.target)
        flag = "(inplace)" if getattr(module, "inplace", False) else ""
        return f"{node.target}:{type(module).__name__}{flag}"
    if node.op == "call_method":
        return f".{node.target}"
    if node.op == "get_attr":
        return f"@{node.target}"
    return getattr(node.target, "__name__", str(node.target))


def _describe_arg(arg: Any) -> str:
    if isinstance(arg, fx.Node):
        return arg.name
    if isinstance(arg, (tuple, list)):
        inner = ", ".join(_describe_arg(a) for a in arg)
        return f"[{inner}]"
    return repr(arg)


def compact(gm: fx.GraphModule, root: nn.Module | None = None) -> str:
    """One line per node, ``name = target(args)``: stable enough to compare against goldens.

    ``root``: the module the graph's targets live on, when ``gm`` holds code only (a region body).
    """
    lines = []
    owner = gm if root is None else root
    for node in gm.graph.nodes:
        if node.op == "placeholder":
            lines.append(f"{node.name} = input")
        elif node.op == "output":
            lines.append(f"return {_describe_arg(node.args[0])}")
        else:
            args = [_describe_arg(a) for a in node.args]
            args += [f"{k}={_describe_arg(v)}" for k, v in node.kwargs.items()]
            lines.append(f"{node.name} = {_describe_target(owner, node)}({', '.join(args)})")
    return "\n".join(lines)


def _dedent(text: str) -> str:
    return "\n".join(line.strip() for line in text.strip().splitlines())


def check_pass(
    model: nn.Module,
    example_inputs: tuple,
    pass_fn: Any,
    *,
    options: dict[str, Any] | None = None,
    golden_before: str | None = None,
    golden_after: str | None = None,
    expect_modified: bool = True,
    memory_not_worse: bool = True,
    capture: str = "fx",
    numerics: bool = True,
) -> tuple[fx.GraphModule, PassResult]:
    """Golden before -> pass -> lint -> golden after -> idempotent -> numerics -> memory.

    ``capture`` picks the frontend ("fx": a module-level graph; "export": an ATen graph);
    ``numerics=False`` skips the training-step checks (for a rewrite meant for inference only).
    """
    options = options or {}
    gm = capture_model(model, example_inputs, capture=capture)
    if golden_before is not None:
        assert compact(gm) == _dedent(golden_before), compact(gm)
    before = snapshot(gm)
    result = pass_fn(gm, **options)
    assert result.graph_module is gm
    assert result.modified is expect_modified, result.stats
    code = gm.code
    gm.recompile()
    assert gm.code == code, "the pass left the module running its old code (no recompile)"
    assert graph_problems(gm, before) == []
    if not expect_modified:
        assert gm.code == before.code
    if golden_after is not None:
        assert compact(gm) == _dedent(golden_after), compact(gm)
    code_after_first = gm.code
    second = pass_fn(gm, **options)
    assert second.modified is False, f"second run changed the graph: {second.stats}"
    assert gm.code == code_after_first
    if not numerics:
        return gm, result
    report = verify(model, gm, example_inputs)
    assert report.ok, str(report)
    if memory_not_worse:
        reference = capture_model(model, example_inputs, capture=capture)
        assert measure_train_step(gm, example_inputs).peak_bytes <= measure_train_step(
            reference, example_inputs).peak_bytes
    return gm, result


class TiedEmbedding(nn.Module):
    """A language-model head that reuses the embedding matrix (tied weights)."""

    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(10, 6)
        self.head = nn.Linear(6, 10, bias=False)
        self.head.weight = self.emb.weight

    def forward(self, tokens):
        return self.head(torch.relu(self.emb(tokens)))


class Snapshot:
    """Everything of the user's model optimize() must leave as it was."""

    def __init__(self, model: nn.Module):
        self.model = model
        self.state = {k: v.clone() for k, v in model.state_dict(keep_vars=True).items()}
        self.objects = {k: v for k, v in model.state_dict(keep_vars=True).items()}
        self.grads = {n: p.grad for n, p in model.named_parameters()}
        self.grad_values = {n: None if g is None else g.clone() for n, g in self.grads.items()}
        self.flags = {n: m.training for n, m in model.named_modules()}
        self.requires_grad = {n: p.requires_grad for n, p in model.named_parameters()}
        self.rng = torch.get_rng_state()

    def assert_unchanged(self) -> None:
        now = self.model.state_dict(keep_vars=True)
        assert list(now) == list(self.state)
        for key, value in now.items():
            assert value is self.objects[key], f"{key} was replaced"
            if value.device.type != "meta":
                assert torch.equal(value, self.state[key]), f"{key} changed"
        for name, p in self.model.named_parameters():
            assert p.grad is self.grads[name], f"{name}.grad replaced"
            if p.grad is not None:
                assert torch.equal(p.grad, self.grad_values[name]), f"{name}.grad changed"
        assert {n: m.training for n, m in self.model.named_modules()} == self.flags
        assert {n: p.requires_grad for n, p in self.model.named_parameters()} == self.requires_grad
        assert torch.equal(torch.get_rng_state(), self.rng), "global RNG state changed"


class WideMLP(nn.Module):
    """Big weights, a tiny batch: the peak is late in backward, when every gradient is alive."""

    def __init__(self, width: int = 256, depth: int = 6):
        super().__init__()
        self.layers = nn.Sequential(*[m for _ in range(depth)
                                      for m in (nn.Linear(width, width), nn.GELU())])

    def forward(self, x):
        return self.layers(x)


def seeded(build: Any, *args: Any) -> Any:
    """``build(*args)`` with torch's RNG seeded 0 for it, the global RNG left as it was."""
    with torch.random.fork_rng():
        torch.manual_seed(0)
        return build(*args)


def grouped_query_llama() -> nn.Module:
    """A random-init 2-layer Hugging Face Llama with grouped-query attention (4 query heads on 2
    key/value heads), hidden 64, vocab 256, built under seed 0 (skips without transformers)."""
    import pytest
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(
        vocab_size=256, hidden_size=64, intermediate_size=256, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
        use_cache=False)
    return seeded(transformers.LlamaForCausalLM, config)


TINY_LLAMA_VOCAB = 128
# A 2-layer random-init Hugging Face Llama (grouped-query attention: 4 query heads on 2 key/value
# heads), as the source of a target file for the command line (``path/to/file.py:llama``).
TINY_LLAMA_SOURCE = f"""
import torch
import transformers


def llama():
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size={TINY_LLAMA_VOCAB}, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
        use_cache=False))
"""


def tiny_llama() -> nn.Module:
    """The model ``TINY_LLAMA_SOURCE`` builds (skips without transformers)."""
    import pytest
    pytest.importorskip("transformers")
    namespace: dict[str, Any] = {}
    exec(TINY_LLAMA_SOURCE, namespace)
    return namespace["llama"]()


def token_batch(size: int, *, seq: int = 32, vocab: int = 256, seed: int = 3
                ) -> dict[str, torch.Tensor]:
    """A causal LM batch as a collator makes it: ``input_ids`` and ``labels``, its own tensor."""
    ids = torch.randint(0, vocab, (size, seq), generator=torch.Generator().manual_seed(seed))
    return {"input_ids": ids, "labels": ids.clone()}


def exit_passed_worker() -> None:
    """End a ``torch.multiprocessing.spawn`` worker whose checks all passed: flush and exit with
    status 0 at once. On a loaded machine gloo's threads can abort the interpreter's own shutdown
    afterwards (``terminate called without an active exception``, SIGABRT), which would fail a
    test whose every assertion held; a worker that failed raises before reaching this."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def step_record(module: nn.Module, x: torch.Tensor, *, seed: int = 0, call: Any = None
                ) -> tuple[torch.Tensor, dict, dict]:
    """Outputs, parameter gradients (of ``out.square().sum()``) and buffers after one training
    step of ``module`` (``call(x)``, default ``module(x)``), the RNG seeded with ``seed`` (the
    same dropout masks in every run); ``module`` is left as it was."""
    from fxopt.core.state import preserved_state

    params = dict(module.named_parameters())
    with preserved_state(module):
        module.train()
        torch.manual_seed(seed)
        out = (module if call is None else call)(x)
        grads = torch.autograd.grad(out.square().sum(), list(params.values()))
        buffers = {name: b.detach().clone() for name, b in module.named_buffers()}
    return out.detach(), dict(zip(params, grads)), buffers


def assert_same_step(got: tuple, expected: tuple, *, buffer_tolerance: dict | None = None
                     ) -> None:
    """Two ``step_record``\\ s agree: outputs and gradients to float rounding, buffers too
    (``buffer_tolerance``: ``assert_close``'s ``rtol``/``atol`` for them)."""
    torch.testing.assert_close(got[0], expected[0])
    assert got[1].keys() == expected[1].keys()
    for name, grad in got[1].items():
        torch.testing.assert_close(grad, expected[1][name], msg=lambda m, n=name: f"{n}: {m}")
    assert got[2].keys() == expected[2].keys()
    for name, value in got[2].items():
        torch.testing.assert_close(value, expected[2][name], **(buffer_tolerance or {}),
                                   msg=lambda m, n=name: f"{n}: {m}")


class Injected(RuntimeError):
    pass


class FailAt(TorchDispatchMode):
    """Counts ATen calls; raises ``Injected`` at call number ``at`` (never when ``at`` is None)."""

    def __init__(self, at: int | None = None):
        super().__init__()
        self.at, self.calls = at, 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.calls += 1
        if self.calls == self.at:
            raise Injected(f"injected at {func}")
        return func(*args, **(kwargs or {}))
