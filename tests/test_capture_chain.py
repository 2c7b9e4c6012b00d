"""capture(..., capture="auto" | "fx" | "export"): which frontend captures a model, and why."""

from __future__ import annotations

import collections
import pickle
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import fx, nn

import fxopt
import fxopt.export
import fxopt.runtime.input_guard
import fxopt.runtime.regions
from fxopt.capture.chain import capture
from fxopt.capture.trace import TraceInfo, trace
from fxopt.core.errors import ConfigError, TraceError

VOCAB, WIDTH, HEADS, LENGTH = 53, 32, 4, 16


class CausalSelfAttention(nn.Module):
    """The causal mask is built here from the input's length: symbolic tracing cannot follow
    ``torch.ones(T, T)`` with ``T`` a proxy, so it keeps this module as an opaque leaf."""

    def __init__(self, p: float = 0.1):
        super().__init__()
        self.qkv = nn.Linear(WIDTH, 3 * WIDTH)
        self.proj = nn.Linear(WIDTH, WIDTH)
        self.p = p

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, C = x.shape
        mask = torch.tril(torch.ones(T, T, device=x.device)).bool()
        q, k, v = self.qkv(x).split(C, dim=-1)
        q, k, v = (t.view(B, T, HEADS, C // HEADS).transpose(1, 2) for t in (q, k, v))
        a = F.scaled_dot_product_attention(q, k, v, attn_mask=mask,
                                           dropout_p=self.p if self.training else 0.0)
        return self.proj(a.transpose(1, 2).reshape(B, T, C))


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(WIDTH), nn.LayerNorm(WIDTH)
        self.attn = CausalSelfAttention()
        self.mlp = nn.Sequential(nn.Linear(WIDTH, 4 * WIDTH), nn.GELU(),
                                 nn.Linear(4 * WIDTH, WIDTH), nn.Dropout(0.1))

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        h = h + self.attn(self.ln1(h))
        return h + self.mlp(self.ln2(h))


class GPT(nn.Module):
    def __init__(self, layers: int = 2):
        super().__init__()
        self.tok = nn.Embedding(VOCAB, WIDTH)
        self.pos = nn.Embedding(LENGTH, WIDTH)
        self.drop = nn.Dropout(0.1)
        self.blocks = nn.ModuleList(Block() for _ in range(layers))
        self.ln_f = nn.LayerNorm(WIDTH)
        self.head = nn.Linear(WIDTH, VOCAB, bias=False)
        self.head.weight = self.tok.weight  # tied

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        h = self.drop(self.tok(idx) + self.pos(torch.arange(idx.shape[1], device=idx.device)))
        for block in self.blocks:
            h = block(h)
        return self.head(self.ln_f(h))


@pytest.fixture(scope="module")
def gpt():
    torch.manual_seed(0)
    return GPT(), torch.randint(0, VOCAB, (4, LENGTH))


@pytest.fixture(scope="module")
def gpt_captured(gpt):
    """One capture of the GPT (``capture="auto"``: the chain tries symbolic tracing, then
    torch.export) for every test that optimizes it (``captured=``): each export capture is three
    torch.export traces. ``capture_model`` runs the chain ``optimize`` runs, and the reused
    capture keeps its record of which frontend captured and why the others did not."""
    model, idx = gpt
    return fxopt.capture_model(model, (idx,))


@pytest.fixture(scope="module")
def gpt_at_07(gpt, gpt_captured):
    """The GPT optimized with ``memory_budget=0.7``: export-captured, with regions."""
    model, idx = gpt
    return fxopt.optimize(model, (idx,), memory_budget=0.7, captured=gpt_captured)


def test_auto_captures_the_gpt_with_export_and_checkpoints_it(gpt_at_07):
    gm = gpt_at_07
    report = gm.fxopt_report
    assert report.trace.frontend == "export" and report.trace.leaves == []
    # export inlines every module; the root graph calls back only the blocks fxopt keeps
    assert [n.target for n in gm.graph.nodes if n.op == "call_module"] == fxopt.blocks(gm)
    assert fxopt.blocks(gm) == ["blocks.0", "blocks.1"]
    (why,) = report.trace.not_used
    assert why[0] == "fx" and why[1].startswith("kept 2 submodule(s) as opaque leaves: ")
    assert "blocks.0.attn (CausalSelfAttention)" in why[1]
    checkpoint = next(p for p in report.passes if p.name == "checkpoint")
    assert checkpoint.modified and checkpoint.stats["regions_count"] >= 1
    assert report.verification.ok, str(report.verification)
    text = str(report)
    assert "captured by export (torch.export)" in text and "fx not used: kept 2" in text
    assert report.as_dict()["trace"]["not_used"] == {"fx": why[1]}


def test_fx_keeps_the_attention_modules_as_opaque_leaves(gpt):
    model, idx = gpt
    gm = capture(model, (idx,), capture="fx")
    info = gm.meta["fxopt_trace"]
    assert info.frontend == "fx"
    assert [leaf.path for leaf in info.leaves] == ["blocks.0.attn", "blocks.1.attn"]
    assert {n.target for n in gm.graph.nodes if n.op == "call_module"} >= {
        "blocks.0.attn", "blocks.1.attn"}
    assert info.not_used == (("export", "capture='fx' was asked for"),)


class RootMask(nn.Module):
    """The mask in the root's own forward: symbolic tracing fails outright."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(WIDTH, WIDTH)

    def forward(self, x):
        T = x.shape[1]
        return self.lin(x) * torch.tril(torch.ones(T, T)).mean(1)[:, None]


def test_export_when_symbolic_tracing_fails_at_the_root():
    x = torch.randn(2, 5, WIDTH)
    with pytest.raises(TraceError):
        capture(RootMask(), (x,), capture="fx")
    gm = capture(RootMask(), (x,))
    info = gm.meta["fxopt_trace"]
    assert info.frontend == "export"
    (name, why), = info.not_used
    assert name == "fx" and why.startswith("torch.fx cannot trace RootMask.forward")


class Gate(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x):
        return self.lin(x) if x.sum() > 0 else -x  # reads a value: neither frontend follows it


class Gated(nn.Module):
    def __init__(self):
        super().__init__()
        self.inp, self.gate = nn.Linear(4, 4), Gate()

    def forward(self, x):
        return self.gate(torch.relu(self.inp(x)))


class RootGated(Gate):
    pass


def test_fx_with_leaves_when_export_fails_too_and_both_reasons_when_neither_works():
    x = torch.randn(3, 4)
    gm = capture(Gated(), (x,))
    info = gm.meta["fxopt_trace"]
    assert info.frontend == "fx" and [leaf.path for leaf in info.leaves] == ["gate"]
    (name, why), = info.not_used
    assert name == "export" and why.startswith("torch.export cannot capture Gated.forward")
    with pytest.raises(TraceError) as error:
        capture(RootGated(), (x,))
    # export's reason leads: it ran forward as Python and names the line that stopped it
    assert error.value.what.startswith("torch.export cannot capture RootGated.forward")
    assert "(symbolic tracing cannot capture it either: torch.fx cannot trace RootGated" in \
        error.value.what
    assert "in forward: return self.lin(x) if x.sum() > 0" in error.value.where


def test_auto_does_not_export_frozen_submodules_or_leaf_modules_and_validates_the_option():
    x = torch.randn(3, 4)
    frozen = Gated()
    frozen.inp.eval()  # export would capture it in train mode with the rest
    (why,) = capture(frozen, (x,)).meta["fxopt_trace"].not_used
    assert why == ("export", "inp is in eval mode, the model in train mode; torch.export "
                             "captures every module in one mode")
    gm = capture(Gated(), (x,), leaf_modules=("inp",))
    assert gm.meta["fxopt_trace"].frontend == "fx"
    assert "leaf_modules" in gm.meta["fxopt_trace"].not_used[0][1]
    # torch.export keeps named leaves too (issue 25): as opaque calls of the modules themselves
    exported = capture(Gated(), (x,), capture="export", leaf_modules=("inp", "gate"))
    assert [n.target for n in exported.graph.find_nodes(op="call_module")] == ["inp", "gate"]
    with pytest.raises(ConfigError) as error:
        fxopt.optimize(Gated(), (x,), capture="bogus")
    assert "'bogus'" in error.value.what and "auto, fx, export" in error.value.hint


class Residual(nn.Module):
    def __init__(self, channels: int):
        super().__init__()
        self.conv1 = nn.Conv2d(channels, channels, 3, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(channels)
        self.conv2 = nn.Conv2d(channels, channels, 3, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(channels)
        self.relu = nn.ReLU(inplace=True)

    def forward(self, x):
        return self.relu(x + self.bn2(self.conv2(self.relu(self.bn1(self.conv1(x))))))


class SmallResNet(nn.Module):
    """torchvision's ResNet in miniature: stem, residual blocks, pooling, classifier."""

    def __init__(self):
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1, bias=False), nn.BatchNorm2d(8),
                                  nn.ReLU(inplace=True))
        self.layer1 = nn.Sequential(Residual(8), Residual(8))
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(8, 10)

    def forward(self, x):
        return self.fc(torch.flatten(self.pool(self.layer1(self.stem(x))), 1))


def _inlined(gm: fx.GraphModule, prefix: str = "") -> list[tuple[str, object]]:
    """(op, target) of each node ``gm``'s graph runs, a call of a block replaced by the nodes of
    the block's graph, targets named from the root: the graph before fxopt kept the blocks."""
    nodes = []
    for node in gm.graph.nodes:
        called = gm.get_submodule(node.target) if node.op == "call_module" else None
        if isinstance(called, fx.GraphModule):
            nodes += [(op, target) for op, target in _inlined(called, f"{prefix}{node.target}.")
                      if op not in ("placeholder", "output")]
        else:
            named = node.op in ("call_module", "get_attr")
            nodes.append((node.op, f"{prefix}{node.target}" if named else node.target))
    return nodes


def test_auto_keeps_the_module_level_graph_of_a_fully_traceable_cnn():
    torch.manual_seed(0)
    model, x = SmallResNet(), torch.randn(2, 3, 16, 16)
    gm = fxopt.optimize(model, (x,), passes=[])
    info = gm.fxopt_report.trace
    assert info.frontend == "fx" and info.leaves == []
    assert info.not_used == (("export", "symbolic tracing captured the whole model"),)
    expected = [(n.op, n.target) for n in trace(model, (x,)).graph.nodes]
    # the residual blocks are calls of their own; inlined, the graph is the trace's
    assert fxopt.blocks(gm) == ["layer1.0", "layer1.1"]
    assert _inlined(gm) == expected
    assert ("call_module", "layer1.0.conv1") in expected
    assert "captured by fx (symbolic tracing)" in str(gm.fxopt_report)


def test_trace_info_pickled_before_the_frontend_fields_loads_with_their_defaults():
    old = TraceInfo()
    del old.frontend, old.not_used  # what unpickling an older TraceInfo leaves in __dict__
    loaded = pickle.loads(pickle.dumps(old))
    assert "frontend" not in vars(loaded)
    assert loaded.frontend == "fx" and loaded.not_used == ()


def test_a_report_saved_before_the_frontend_fields_still_prints():
    from pathlib import Path

    saved = torch.load(Path(__file__).parent / "data" / "legacy_checkpointed_module.pt",
                       weights_only=False)
    report = saved["module"].fxopt_report
    assert "frontend" not in vars(report.trace)
    assert "captured by fx (symbolic tracing)" in str(report)
    assert report.as_dict()["trace"]["not_used"] == {}


def test_an_export_captured_module_pickles_with_its_input_guard(tmp_path):
    """The guard is a module attribute read by an importable function, so torch.save keeps it.
    (A module with a graph per training mode does not pickle: fxopt.graph.train_eval.)"""
    x = torch.randn(2, 5, WIDTH)
    gm = fxopt.optimize(RootMask(), (x,))
    assert gm.fxopt_report.trace.frontend == "export"
    torch.save(gm, tmp_path / "gm.pt")
    loaded = torch.load(tmp_path / "gm.pt", weights_only=False)
    torch.testing.assert_close(loaded(x), gm(x), rtol=0, atol=0)
    other = torch.randn(3, 7, WIDTH)  # batch and length stay dynamic through the pickle
    torch.testing.assert_close(loaded(other), gm(other), rtol=0, atol=0)
    with pytest.raises(fxopt.InputError, match=f"x.shape\\[2\\] == {WIDTH} only"):
        loaded(torch.randn(2, 5, WIDTH + 1))


class ReturnsAPair(nn.Module):
    """RootMask's forward, its output in a namedtuple, as many models return theirs."""

    Pair = collections.namedtuple("Pair", "out total")

    def __init__(self):
        super().__init__()
        self.inner = RootMask()

    def forward(self, x: torch.Tensor):
        out = self.inner(x)
        return self.Pair(out, out.sum())


def test_an_export_captured_module_that_rebuilds_its_output_class_refuses_torch_save(tmp_path):
    """torch.fx's pickling re-traces the code on load, and the namedtuple (a Hugging Face
    ModelOutput alike) would come back a plain tuple: a clear ExportError instead."""
    x = torch.randn(2, 5, WIDTH)
    gm = fxopt.optimize(ReturnsAPair(), (x,))
    assert gm.fxopt_report.trace.frontend == "export" and type(gm(x)).__name__ == "Pair"
    with pytest.raises(fxopt.ExportError, match="output's classes") as info:
        torch.save(gm, tmp_path / "gm.pt")
    assert "state_dict()" in info.value.hint


def test_an_export_captured_checkpointed_gpt_exports_as_a_folder_that_guards_its_inputs(
        gpt, gpt_at_07, tmp_path):
    """fxopt.export writes the guard as code that raises without fxopt installed."""
    _, idx = gpt
    gm = gpt_at_07
    graphs = [gm.graph, *(gm.get_submodule(path).graph for path in fxopt.blocks(gm))]
    assert any(n.target is fxopt.runtime.regions.call_region for g in graphs for n in g.nodes)
    nodes = list(gm.graph.nodes)  # the guard runs before the first region or block
    guard = next(n for n in nodes if n.target is fxopt.runtime.input_guard.guard_inputs)
    first = next(n for n in nodes if n.target is fxopt.runtime.regions.call_region
                 or n.op == "call_module")
    assert nodes.index(guard) < nodes.index(first)

    result = fxopt.export.export(gm, tmp_path / "folder", example_inputs=(idx,))
    assert result.verification.ok and result.needs == []
    assert "_runtime_fxopt_runtime_input_guard.py" in result.files
    site_packages = Path(torch.__file__).resolve().parent.parent
    script = textwrap.dedent(f"""
        import importlib.util, sys
        sys.path[:] = [p for p in sys.path if p not in ('', '.')]
        sys.path += [{str(site_packages)!r}, {str(tmp_path)!r}]
        assert importlib.util.find_spec('fxopt') is None
        import torch, folder
        net = folder.load()
        try:
            net(torch.zeros(4, 1, dtype=torch.long))
        except Exception as error:
            print(type(error).__name__, str(error).splitlines()[0])
    """)
    done = subprocess.run([sys.executable, "-S", "-I", "-c", script], capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.startswith("InputError GPT was captured by torch.export for "
                                  "idx.shape[1] in [2, inf]"), done.stdout


def test_least_memory_plan_of_the_gpt_uses_no_more_than_any_fraction(gpt, gpt_captured):
    """'min' weighs the solver's least-memory plan against one region per block and keeps the
    lower prediction; measured, it holds no more than any fraction's plan."""
    model, idx = gpt
    least = fxopt.optimize(model, (idx,), memory_budget="min", captured=gpt_captured)
    assert least.fxopt_report.verification.ok
    peak = fxopt.measure_train_step(least, (idx,)).peak_bytes
    compared = []
    for fraction in (0.8, 0.6, 0.5):  # the least-memory plan reaches 0.541 of the activations
        try:
            other = fxopt.optimize(model, (idx,), memory_budget=fraction, verify=False,
                                   predict_memory=False, captured=gpt_captured)
        except fxopt.BudgetError:
            continue
        assert peak <= fxopt.measure_train_step(other, (idx,)).peak_bytes, fraction
        compared.append(fraction)
    assert compared == [0.8, 0.6], compared  # 0.5 is below the least-memory plan: refused


def test_torch_save_of_a_module_with_a_graph_per_mode_is_a_clear_error(gpt, gpt_captured,
                                                                       tmp_path):
    model, idx = gpt
    gm = fxopt.optimize(model, (idx,), captured=gpt_captured)
    with pytest.raises(fxopt.ExportError, match="graph per training mode") as info:
        torch.save(gm, tmp_path / "gm.pt")
    assert "state_dict()" in info.value.hint and "fxopt.export" in info.value.hint
    torch.save(gm.state_dict(), tmp_path / "state.pt")  # what the error suggests works
