"""torch.compile (inductor, CPU) of optimized modules from both capture paths (issue 23, item 3).

Two tiny language models of one block each, optimized with ``memory_budget="min"`` so that
backward recomputes checkpoint regions: a GPT-like model captured by symbolic tracing
(``models_zoo``'s TinyLanguageModel, dropout off) and a Hugging Face Llama captured by
torch.export (``verify=False``: the comparisons below are the check). Each optimized module is
compiled whole, and block by block (``block.compile()``), and must give

- the same graphs as the original: as many, with no more breaks (``torch._dynamo.explain`` of the
  whole module in training and in eval mode, and of each block; for the optimized blocks a
  counting backend in front of inductor, which also shows each block was called). fxopt's
  runtime (checkpointed regions, the input guard, the eval-mode dispatch) must not break graphs.
- the loss and gradients of ``torch.compile(original)``, to float32 rounding: rtol 1e-5, atol
  1e-6 (bit-equal on torch 2.14 for the whole module). Both sides compile the same ATen ops with
  the same inductor, but recomputing a region in backward, or compiling block by block, can put
  ops into other fused kernels than the compiled original's, which may sum in another order; a
  dozen float32 ulps stay far inside rtol 1e-5.

``fxopt.measure`` of a compiled module measures the compiled code at allocator level (storage
tracking would make dynamo run the eager code), and the op-by-op tools refuse it.

Compile time is most of this file's: inductor runs g++ once per kernel. To keep CI short the
models are tiny (one block: a block is a numbered item of a ModuleList or Sequential, however
many there are) and inductor's CPU kernels are compiled unvectorized (``cpp.vec_isa_ok=False``:
about half the compiler time, on both sides alike) and in-process (``compile_threads=1``).
"""

import contextlib

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import fxopt
from fxopt.core.torch_private import COMPILED_CALL, compile_backend
from fxopt.measure.breakdown import memory_breakdown
from fxopt.measure.timeline import training_timeline
from fxopt.runtime.regions import CheckpointedRegion
from fxopt.models_zoo.transformer import TinyLanguageModel

GRAD_TOLERANCE = {"rtol": 1e-5, "atol": 1e-6}
VOCAB, SEQ, BATCH = 64, 8, 2


@pytest.fixture(scope="module", autouse=True)
def quick_inductor():
    from torch._inductor import config

    with config.patch({"cpp.vec_isa_ok": False, "compile_threads": 1}):
        yield
    torch.compiler.reset()


class Case:
    """An original model, its optimized module, a call's arguments, its loss, and its blocks."""

    def __init__(self, original, optimized, args, kwargs, loss, blocks):
        self.original, self.optimized = original, optimized
        self.args, self.kwargs, self.loss, self.blocks = args, kwargs, loss, blocks
        self._reference = None

    def call(self, module):
        return module(*self.args, **self.kwargs)

    def compiled_original_step(self) -> tuple[torch.Tensor, dict]:
        """The loss and gradients of ``torch.compile(original)`` (compiled once per case)."""
        if self._reference is None:
            compiled = torch.compile(self.original)
            self._reference = train_step(self, self.original, lambda a, k: compiled(*a, **k))
        return self._reference


def gpt_fx() -> Case:
    def build():
        torch.manual_seed(0)
        model = TinyLanguageModel(vocab_size=VOCAB, dim=16, heads=2, depth=1, max_seq_len=SEQ)
        for module in model.modules():
            if isinstance(module, nn.Dropout):
                module.p = 0.0  # compiled and eager dropout draw different masks
        return model

    tokens = torch.randint(0, VOCAB, (BATCH, SEQ), generator=torch.Generator().manual_seed(1))
    optimized = fxopt.optimize(build(), tokens, memory_budget="min", verify=False,
                               predict_memory=False)
    assert optimized.fxopt_report.trace.frontend == "fx"
    return Case(build(), optimized, (tokens,), {},
                lambda out: F.cross_entropy(out.flatten(0, 1), tokens.flatten()),
                ["blocks.0"])


def llama_export() -> Case:
    transformers = pytest.importorskip("transformers")

    def build():
        torch.manual_seed(0)
        return transformers.LlamaForCausalLM(transformers.LlamaConfig(
            vocab_size=VOCAB, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
            num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=2 * SEQ,
            use_cache=False))

    ids = torch.randint(0, VOCAB, (BATCH, SEQ), generator=torch.Generator().manual_seed(1))
    kwargs = {"input_ids": ids, "labels": ids}
    optimized = fxopt.optimize(build(), (), example_kwargs=kwargs, memory_budget="min",
                               verify=False, predict_memory=False)
    assert optimized.fxopt_report.trace.frontend == "export"
    return Case(build(), optimized, (), kwargs, lambda out: out.loss,
                ["model.layers.0"])


CASES = {"gpt_fx": gpt_fx, "llama_export": llama_export}


@pytest.fixture(scope="module", params=list(CASES))
def case(request) -> Case:
    built = CASES[request.param]()
    regions = [value for module in built.optimized.modules() for value in vars(module).values()
               if isinstance(value, CheckpointedRegion)]
    assert regions, "memory_budget='min' planned no checkpoint region: nothing is tested"
    return built


def train_step(case, module: nn.Module, call) -> tuple[torch.Tensor, dict]:
    """Loss and parameter gradients of one training step; grads are cleared before and after."""
    module.train()
    for p in module.parameters():
        p.grad = None
    loss = case.loss(call(case.args, case.kwargs))
    loss.backward()
    grads = {name: p.grad for name, p in module.named_parameters()}
    for p in module.parameters():
        p.grad = None
    return loss.detach(), grads


def assert_same_step(got, expected) -> None:
    torch.testing.assert_close(got[0], expected[0], **GRAD_TOLERANCE)
    assert got[1].keys() == expected[1].keys()
    for name, grad in got[1].items():
        assert grad is not None, f"{name}: no gradient"
        torch.testing.assert_close(grad, expected[1][name], **GRAD_TOLERANCE,
                                   msg=lambda m, n=name: f"{n}: {m}")


def explained(case: Case, module: nn.Module, mode: str):
    getattr(module, mode)()
    torch.compiler.reset()
    with torch.set_grad_enabled(mode == "train"):
        return torch._dynamo.explain(module)(*case.args, **case.kwargs)


@pytest.mark.parametrize("mode", ["train", "eval"])
def test_the_optimized_module_compiles_to_as_many_graphs(case, mode):
    reference = explained(case, case.original, mode)
    got = explained(case, case.optimized, mode)
    reasons = [str(reason.reason) for reason in got.break_reasons]
    assert (got.graph_count, got.graph_break_count) == (
        reference.graph_count, reference.graph_break_count), reasons
    assert got.graph_break_count == 0, reasons


def test_whole_module_compile_matches_the_compiled_original(case):
    torch.compiler.reset()
    expected = case.compiled_original_step()
    compiled = torch.compile(case.optimized)
    got = train_step(case, case.optimized, lambda a, k: compiled(*a, **k))
    assert_same_step(got, expected)

    # measuring the compiled module measures the compiled code, not the eager one
    figure = fxopt.measure_train_step(compiled, case.args, case.kwargs)
    assert "torch.compile'd code (the module itself)" in figure.method
    assert figure.step_peak_bytes > 0


class CountingInductor:
    """Inductor, counting the graphs it is given."""

    def __init__(self):
        self.graphs = 0
        self.inductor = compile_backend("inductor")

    def __call__(self, graph, example_inputs):
        self.graphs += 1
        return self.inductor(graph, example_inputs)


@contextlib.contextmanager
def blocks_compiled(module: nn.Module, paths: list[str]):
    """``block.compile()`` on each block, undone on exit; yields each block's graph counter."""
    counters = {path: CountingInductor() for path in paths}
    try:
        for path, counter in counters.items():
            module.get_submodule(path).compile(backend=counter)
        yield counters
    finally:
        for path in paths:
            setattr(module.get_submodule(path), COMPILED_CALL, None)


def block_graphs(case: Case) -> dict[str, int]:
    """How many graphs ``torch._dynamo.explain`` makes of each of the original's blocks, called
    with what the original model passes it."""
    calls, handles = {}, []
    for path in case.blocks:
        def keep(module, args, kwargs, path=path):
            calls[path] = (args, kwargs)
        handles.append(case.original.get_submodule(path).register_forward_pre_hook(
            keep, with_kwargs=True))
    try:
        case.original.train()
        case.call(case.original)
    finally:
        for handle in handles:
            handle.remove()
    graphs = {}
    for path, (args, kwargs) in calls.items():
        torch.compiler.reset()
        graphs[path] = torch._dynamo.explain(case.original.get_submodule(path))(
            *args, **kwargs).graph_count
    return graphs


def test_per_block_compile_matches_the_original(case):
    """Each block compiled on its own (as one compiles blocks for FSDP2): every block of the
    optimized module is called, compiles to as many graphs as the original's block, and the step
    gives the loss and gradients of the compiled original (compiled whole: per-block compilation
    of the original would cost CI another compile and be compared to the same tolerance)."""
    expected_graphs = block_graphs(case)
    expected = case.compiled_original_step()
    torch.compiler.reset()
    with blocks_compiled(case.optimized, case.blocks) as counters:
        got = train_step(case, case.optimized, lambda a, k: case.optimized(*a, **k))
    graphs = {path: counter.graphs for path, counter in counters.items()}
    assert all(graphs.values()), f"blocks the optimized graph never called: {graphs}"
    assert graphs == expected_graphs
    assert_same_step(got, expected)


# fxopt.measure of compiled modules


class Chain(nn.Module):
    """An elementwise chain inductor fuses into one kernel: eager keeps two temporaries of x's
    size alive at once, the compiled code allocates only its output."""

    def __init__(self):
        super().__init__()
        self.scale = nn.Parameter(torch.tensor(2.0))

    def forward(self, x):
        return ((x * self.scale) + 1).sin().cos()


class Outer(nn.Module):
    def __init__(self):
        super().__init__()
        self.chain = Chain()

    def forward(self, x):
        return self.chain(x)


def test_measure_of_a_compiled_module_measures_the_compiled_code():
    x = torch.randn(1 << 18)  # 1 MiB
    size = x.numel() * x.element_size()
    eager = fxopt.measure_inference(Chain(), x)
    assert eager.step_peak_bytes == 2 * size and "tracking" in eager.method

    torch.compiler.reset()
    whole = fxopt.measure_inference(torch.compile(Chain()), x)
    assert whole.step_peak_bytes == size, whole
    assert "CPU allocator" in whole.method and "(the module itself)" in whole.method
    assert whole.baseline_bytes == eager.baseline_bytes

    outer = Outer()
    outer.chain.compile()  # a compiled block inside a module that is not compiled
    try:
        report = fxopt.measure(outer, x)
    finally:
        setattr(outer.chain, COMPILED_CALL, None)
    assert report.inference.step_peak_bytes == size
    assert "torch.compile'd code (chain)" in report.train.method
    assert report.train.grads_at_peak_bytes == 0  # not told apart at allocator level
    assert "not told apart" in str(report)
    assert outer.chain.scale.grad is None  # the warm-up and the measured step left no trace


def test_op_by_op_tools_refuse_compiled_modules():
    compiled = torch.compile(Chain())
    x = torch.randn(16)
    with pytest.raises(fxopt.InputError, match="cannot see inside torch.compile'd code"):
        training_timeline(compiled, x)
    with pytest.raises(fxopt.InputError, match="measures the compiled peaks"):
        memory_breakdown(compiled, x)
