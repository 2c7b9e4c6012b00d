"""fxopt.analysis: liveness, alias classes, saved-for-backward, peak estimate, max batch size.

Expectations on tiny graphs are computed by hand (and, for saved tensors, are what autograd in
torch 2.14 really saves on CPU). The zoo test checks the fake-tensor estimate against the
measured CPU peak and prints the table (visible with ``pytest -s`` or ``-rA``).
"""

from __future__ import annotations

import operator
import re

import pytest
import torch
import torch.nn.functional as F
from torch import fx, nn
from torch.utils._pytree import tree_leaves

import fxopt
from fxopt import models_zoo
from fxopt.analysis import (
    alias_classes,
    estimate_peak,
    last_use,
    max_batch_size,
    saved_for_backward,
)
from fxopt.core.graphs import placeholder_values
from fxopt.capture.trace import trace
from fxopt.core.errors import BudgetError, InputError
from fxopt.measure.peaks import measure_inference, measure_train_step
from helpers import grouped_query_llama, token_batch


def by_name(gm: fx.GraphModule) -> dict[str, fx.Node]:
    return {n.name: n for n in gm.graph.nodes}


def names(nodes) -> list[str]:
    return [n.name for n in nodes]


# ---------------------------------------------------------------- last_use


class FourNodes(nn.Module):
    def forward(self, x):
        a = torch.relu(x)
        unused = torch.neg(x)  # noqa: F841 -- a value nobody reads
        return a + x


def test_last_use_on_four_nodes():
    gm = trace(FourNodes(), (torch.randn(3),))
    nodes = by_name(gm)
    assert names(n for n in gm.graph.nodes) == ["x", "relu", "neg", "add", "output"]
    got = {k.name: v.name for k, v in last_use(gm).items()}
    assert got == {"x": "add", "relu": "add", "neg": "neg", "add": "output"}
    assert last_use(gm)[nodes["x"]] is nodes["add"]


def test_last_use_matches_the_generated_code():
    """Each ``a = b = None`` FX emits after a node frees exactly the values whose last use it is."""

    class Chain(nn.Module):
        def forward(self, x, y):
            a = x * y
            b = torch.sigmoid(a)
            c = b + a
            d = c.t()
            return d @ y, c

    gm = trace(Chain(), (torch.randn(3, 3), torch.randn(3, 3)))
    freed_after: dict[str, set[str]] = {}
    for line in gm.code.splitlines():
        match = re.match(r"\s+(\w+) = .*?;\s+((?:\w+ = )+)None$", line)
        if match:
            freed_after[match.group(1)] = set(match.group(2).replace(" ", "").split("=")) - {""}
    expected: dict[str, set[str]] = {}
    for value, last in last_use(gm).items():
        if last.op != "output":
            expected.setdefault(last.name, set()).add(value.name)
    assert freed_after == expected


# ---------------------------------------------------------------- alias_classes


class Views(nn.Module):
    def __init__(self):
        super().__init__()
        self.lstm = nn.LSTM(4, 4, batch_first=True)

    def forward(self, x):
        a = x * 2
        v = a.view(-1)
        t = a.t()
        r = a.relu_()
        b = a + 1
        out, (h, c) = self.lstm(b.unsqueeze(0))
        return v, t, r, b, out, h


def test_alias_classes_views_inplace_and_getitem():
    gm = trace(Views(), (torch.randn(3, 4),))
    nodes = by_name(gm)
    classes = alias_classes(gm)

    def same(*names: str) -> bool:
        return len({classes[nodes[n]] for n in names}) == 1

    assert classes[nodes["x"]] == 0  # ids are numbered by each class's first node
    assert same("mul", "view", "t", "relu_")
    assert not same("mul", "x") and not same("mul", "add") and not same("x", "add")
    assert same("add", "unsqueeze")
    lstm_getitems = [n.name for n in gm.graph.nodes if n.target is operator.getitem]
    assert lstm_getitems and same("lstm", *lstm_getitems)
    assert not same("lstm", "add")
    assert "output" not in {n.name for n in classes}


def test_alias_classes_fall_back_to_the_view_table_without_meta():
    gm = trace(Views(), (torch.randn(3, 4),))
    nodes = by_name(gm)
    for name in ("view", "t", "relu_", "add"):
        del nodes[name].meta["val"]
    classes = alias_classes(gm)
    assert classes[nodes["view"]] == classes[nodes["t"]] == classes[nodes["relu_"]] == classes[
        nodes["mul"]]
    assert classes[nodes["add"]] != classes[nodes["mul"]]


# ---------------------------------------------------------------- saved_for_backward


def saved_of(model: nn.Module, *inputs: torch.Tensor, **trace_kwargs):
    gm = trace(model, inputs, **trace_kwargs)
    return gm, by_name(gm), saved_for_backward(gm, inputs)


class Ops(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(6, 6)
        self.lin2 = nn.Linear(6, 6)

    def forward(self, x):
        a = self.lin(x)
        b = self.lin2(x)
        r = torch.relu(a)
        s = torch.sigmoid(b)
        t = torch.tanh(r)
        m = r * s
        return m + t


def test_saved_linear_relu_sigmoid_tanh_mul_add():
    gm, n, saved = saved_of(Ops(), torch.randn(2, 6))
    assert names(saved[n["lin"]].values) == ["x"]  # its input; not its output
    assert saved[n["lin"]].params == ()  # x needs no grad, so autograd does not keep the weight
    assert names(saved[n["relu"]].values) == ["relu"]
    assert names(saved[n["sigmoid"]].values) == ["sigmoid"]
    assert names(saved[n["tanh"]].values) == ["tanh"]
    assert names(saved[n["mul"]].values) == ["relu", "sigmoid"]
    assert saved[n["add"]].values == () and saved[n["add"]].internal_bytes == 0
    assert all(info.internal_bytes == 0 and info.source == "autograd" for info in saved.values())
    assert n["mul"].meta["fxopt_saved"] is saved[n["mul"]]


def test_saved_linear_keeps_its_weight_when_the_input_needs_grad():
    _, n, saved = saved_of(nn.Sequential(nn.Linear(4, 3)), torch.randn(2, 4, requires_grad=True))
    assert names(saved[n["_0"]].values) == ["input_1"]
    assert saved[n["_0"]].params == ("0.weight",)


def test_saved_batchnorm_input_stats_weight_and_mean_invstd():
    channels = 5
    _, n, saved = saved_of(nn.Sequential(nn.Conv2d(3, channels, 1), nn.BatchNorm2d(channels)),
                           torch.randn(2, 3, 4, 4))
    info = saved[n["_1"]]
    assert names(info.values) == ["_0"]
    assert info.params == ("1.running_mean", "1.running_var", "1.weight")
    assert info.internal_bytes == 2 * channels * 4  # save_mean and save_invstd, float32


def test_saved_dropout_mask_and_maxpool_indices():
    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.conv = nn.Conv2d(1, 2, 3, padding=1)

        def forward(self, x):
            y = F.dropout(self.conv(x), 0.5, training=True)
            return F.max_pool2d(y, 2)

    _, n, saved = saved_of(Net(), torch.randn(2, 1, 8, 8))
    assert saved[n["dropout"]].values == ()
    assert saved[n["dropout"]].internal_bytes == 2 * 2 * 8 * 8 * 4  # CPU mask: float32, not bool
    assert names(saved[n["max_pool2d"]].values) == ["dropout"]
    assert saved[n["max_pool2d"]].internal_bytes == 2 * 2 * 4 * 4 * 8  # int64 indices
    assert names(saved[n["conv"]].values) == ["x"]
    assert saved[n["conv"]].params == ("conv.weight",)


class Gated(nn.Module):
    def forward(self, x):
        return torch.sigmoid(x) * 3


class DataDependent(nn.Module):
    def forward(self, x):
        if x.sum() > 0:
            return torch.tanh(x)
        return torch.relu(x)


class WithLeaves(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.gate = Gated()
        self.branch = DataDependent()

    def forward(self, x):
        return self.branch(self.gate(self.lin(x)))


def test_saved_through_leaf_modules_and_table_fallback():
    gm, n, saved = saved_of(WithLeaves(), torch.randn(2, 4), leaf_modules=("gate",))
    assert n["branch"].op == "call_module" and n["gate"].op == "call_module"
    gate = saved[n["gate"]]
    assert gate.source == "autograd" and gate.values == ()
    assert gate.internal_bytes == 2 * 4 * 4  # sigmoid's output, inside the leaf: no graph value
    branch = saved[n["branch"]]
    # `if x.sum() > 0` cannot run on fake tensors as it is: it replays its real run on the
    # example inputs (fxopt.graph.leaf_tape), so autograd itself says what it saves
    assert n["branch"].meta["fxopt_leaf"].replays
    assert branch.source == "autograd"
    # the gate's output (3 * sigmoid) is positive, so the tanh branch ran: it saves its output
    assert names(branch.values) == ["branch"]


def test_saved_table_fallback_for_a_leaf_with_no_real_run():
    gm, n, _ = saved_of(WithLeaves(), torch.randn(2, 4), leaf_modules=("gate",))
    del n["branch"].meta["fxopt_leaf"]  # as when the model could not be run for real
    branch = saved_for_backward(gm, (torch.randn(2, 4),))[n["branch"]]
    assert branch.source == "table"  # `if x.sum() > 0` cannot run on fake tensors
    assert names(branch.values) == ["gate"]


def test_saved_lstm_workspace_is_counted_at_its_real_size():
    """The fake LSTM kernel returns an empty oneDNN workspace; the real one is saved for backward."""
    model = nn.Sequential(nn.LSTM(6, 8))
    x = torch.randn(5, 3, 6)
    _, n, saved = saved_of(model, x)
    workspace_bytes = _real_saved_internal_bytes(model, x)
    assert workspace_bytes > 0
    assert saved[n["_0"]].internal_bytes == workspace_bytes


class _LstmHead(nn.Module):
    """An LSTM (its CPU kernel's workspace is corrected on fakes), then ops fake tensors run
    through decompositions (GELU's backward, LayerNorm)."""

    def __init__(self):
        super().__init__()
        self.lstm = nn.LSTM(6, 8)
        self.head = nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.LayerNorm(16))

    def forward(self, x):
        return self.head(self.lstm(x)[0]).square().mean()


def test_a_tracker_observing_the_fake_mode_counts_what_it_counts_stacked_above_it():
    """Predictions count through ``LiveStorageTracker.observing(mode)`` (one trip through
    Python per op fewer): the fake mode calls the tracker around each op it is handed, the ops
    a dispatch mode stacked right above it sees, so both give the same timeline op by op. (The
    first fake run of an op can differ from later ones: torch caches how a fake kernel's output
    is made; a warm-up run comes first.)"""
    from fxopt.analysis.memtrack import LiveStorageTracker
    from fxopt.core.step import training_step
    from fxopt.graph.fake_run import on_fake_tensors

    model, x = _LstmHead(), torch.randn(5, 3, 6)
    found = []
    for observing in (False, False, True):
        with on_fake_tensors(model, x) as run:
            tracker = LiveStorageTracker(record_timeline=True)
            with tracker.observing(run.mode) if observing else tracker:
                training_step(model, run.inputs)
        found.append((tracker.peak_bytes, tracker.peak_op, tracker.timeline))
    assert found[2] == found[1]
    assert {"mkldnn_rnn_layer", "mkldnn_rnn_layer_backward", "native_layer_norm"} <= {
        op for op, _ in found[2][2]}


def _real_saved_internal_bytes(module: nn.Module, x: torch.Tensor) -> int:
    """Bytes of saved tensors that are no input, output or parameter, from a real run."""
    known = {t.untyped_storage().data_ptr() for t in [x, *module.parameters()]}
    packed: list[torch.Tensor] = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: packed.append(t) or t, lambda t: t):
        out = module(x)
    known |= {t.untyped_storage().data_ptr() for t in tree_leaves(out)}
    internal = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in packed
                if t.untyped_storage().data_ptr() not in known}
    return sum(internal.values())


# ---------------------------------------------------------------- estimate_peak


def test_estimate_peak_of_linear_relu_by_hand():
    model = nn.Sequential(nn.Linear(4, 3, bias=False), nn.ReLU())
    x = torch.randn(2, 4)
    weight, inputs, activation = 3 * 4 * 4, 2 * 4 * 4, 2 * 3 * 4
    for module in (model, trace(model, (x,))):
        estimate = estimate_peak(module, (x,))
        assert estimate.baseline_bytes == weight + inputs
        # forward: the matmul output, then ReLU's output; the matmul's is dropped after ReLU
        assert estimate.inference_bytes == weight + inputs + 2 * activation
        # backward: ReLU's saved output + cotangent + grad of its input + the weight's grad
        assert estimate.train_bytes == weight + inputs + 3 * activation + weight
        assert estimate.train_peak_op == "mm"
    gm = trace(model, (x,))
    assert estimate_peak(gm, placeholder_values(gm)) == estimate_peak(gm, (x,))  # fakes as inputs


def test_estimate_peak_stands_in_for_leaves_that_cannot_run_on_fakes():
    model = WithLeaves()
    x = torch.randn(2, 4)
    gm = trace(model, (x,))
    assert by_name(gm)["branch"].meta["fxopt_meta_source"] == "real"
    estimate = estimate_peak(gm, (x,))
    assert estimate.train_bytes == measure_train_step(gm, (x,)).peak_bytes
    with pytest.raises(InputError, match="cannot run on fake tensors"):
        estimate_peak(model, (x,))


# ---------------------------------------------------------------- no side effects


class BnDropout(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3)
        self.bn = nn.BatchNorm2d(4)
        self.drop = nn.Dropout(0.5)

    def forward(self, x):
        return self.drop(torch.relu(self.bn(self.conv(x)))).sum(dim=(2, 3))


def test_no_analysis_touches_rng_bn_stats_grads_flags_or_graph():
    model = BnDropout()
    x = torch.randn(2, 3, 8, 8)
    gm = trace(model, (x,))
    code = gm.code
    state = {k: v.clone() for k, v in model.state_dict().items()}
    rng = torch.random.get_rng_state()
    last_use(gm)
    alias_classes(gm)
    saved_for_backward(gm, (x,))
    estimate_peak(gm, (x,))
    estimate_peak(model, (x,))
    model.eval()
    estimate_peak(model, (x,))
    max_batch_size(model, (x,), 10**7)
    assert not model.training and all(not m.training for m in model.modules())
    model.train()
    assert torch.equal(torch.random.get_rng_state(), rng)
    assert all(torch.equal(model.state_dict()[k], v) for k, v in state.items())
    assert all(p.grad is None for p in model.parameters())
    assert gm.code == code and gm.training and all(m.training for m in gm.modules())


class RootLevelWeights(nn.Module):
    """Parameters read by the root's own forward (``get_attr``), not through a submodule call:
    a checkpointed region's body holds its own references to them."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.w = nn.ParameterList([nn.Parameter(torch.randn(64, 64) / 8) for _ in range(6)])

    def forward(self, x):
        for w in self.w:
            x = torch.tanh(F.linear(x, w))
        return x


def test_estimating_a_checkpointed_module_computes_on_stand_ins_only():
    model, x = RootLevelWeights(), torch.randn(256, 64)
    gm = fxopt.optimize(model, x, memory_budget=740_000, verify=False)
    assert any(name.startswith("_fxopt_region_") for name in vars(gm))
    estimate_peak(gm, (x,))
    assert all(p.grad is None for p in model.parameters())


# ---------------------------------------------------------------- max_batch_size


@pytest.mark.parametrize("name", ["mlp", "odd_channel_cnn", "transformer_block"])
def test_max_batch_size_against_measurement(name):
    entry = models_zoo.get(name)
    model = entry.build()
    budget = int(1.3 * measure_train_step(model, entry.example_inputs(entry.default_batch)).peak_bytes)
    batch = max_batch_size(model, entry.example_inputs(entry.default_batch), budget)
    assert batch > entry.default_batch
    assert measure_train_step(model, entry.example_inputs(batch)).peak_bytes <= budget
    assert measure_train_step(model, entry.example_inputs(batch + 1)).peak_bytes > budget


def test_max_batch_size_along_another_dim_and_budget_error():
    model = nn.LSTM(6, 8)  # (seq, batch, features): the batch is dim 1
    x = torch.randn(5, 3, 6)
    budget = measure_train_step(model, torch.randn(5, 7, 6)).peak_bytes
    assert max_batch_size(model, (x,), budget, batch_dim=1) == 7
    with pytest.raises(BudgetError, match=r"even batch 1 does not fit: its predicted training peak is [\d,]+ bytes"):
        max_batch_size(model, (x,), 1000, batch_dim=1)


def test_estimate_peak_and_max_batch_size_take_keyword_inputs_as_optimize_does():
    """A Hugging Face batch is keywords (``input_ids``, ``labels``): both take it as
    ``example_kwargs``, bound to forward's parameters as ``optimize`` and ``measure`` bind it
    (a TypeError before), and predict what the positional call predicts."""
    model = grouped_query_llama()

    def batch(size: int) -> dict[str, torch.Tensor]:
        return token_batch(size, seed=size)

    estimate = estimate_peak(model, example_kwargs=batch(2))
    assert estimate.train_backward_from == "the model's loss (output.loss)"
    positional = batch(2)
    assert estimate == estimate_peak(model, (positional["input_ids"], None, None, None, None,
                                             positional["labels"]))
    measured = measure_train_step(model, (), batch(2)).peak_bytes
    assert abs(estimate.train_bytes - measured) <= 0.05 * measured
    at_four = estimate_peak(model, example_kwargs=batch(4)).train_bytes
    assert max_batch_size(model, (), at_four, example_kwargs=batch(2)) == 4
    with pytest.raises(InputError, match="input_idz"):
        estimate_peak(model, example_kwargs={"input_idz": batch(2)["input_ids"]})


# ---------------------------------------------------------------- accuracy over the zoo


def accuracy_rows(names_and_batches) -> list[tuple[str, int, str, int, int]]:
    rows = []
    for name, batch in names_and_batches:
        entry = models_zoo.get(name)
        model, inputs = entry.build(), entry.example_inputs(batch)
        estimate = estimate_peak(model, inputs)
        rows.append((name, batch, "train", estimate.train_bytes,
                     measure_train_step(model, inputs).peak_bytes))
        rows.append((name, batch, "inference", estimate.inference_bytes,
                     measure_inference(model, inputs).peak_bytes))
    return rows


@pytest.mark.slow
def test_estimate_within_5_percent_of_measured_cpu_peak_on_the_zoo():
    cases = [(name, batch) for name in models_zoo.names() if "large" not in models_zoo.get(name).tags
             for batch in sorted({1, models_zoo.get(name).default_batch})]
    rows = accuracy_rows(cases)
    lines = [f"estimate_peak vs measured peak (device: cpu, torch {torch.__version__})",
             f"{'model':<18} {'batch':>5} {'figure':<9} {'predicted':>13} {'measured':>13} {'error':>8}"]
    for name, batch, figure, predicted, measured in rows:
        lines.append(f"{name:<18} {batch:>5} {figure:<9} {predicted:>13,} {measured:>13,} "
                     f"{100 * (predicted - measured) / measured:>+7.2f}%")
    print("\n" + "\n".join(lines))
    assert len({name for name, *_ in rows}) == len(models_zoo.names()) - 1
    bad = [line for line, (*_, p, m) in zip(lines[2:], rows) if abs(p - m) > 0.05 * m]
    assert not bad, "\n".join(bad)


def test_heavy_nodes_are_what_selective_regions_keep_at_run_time():
    """The planner's "heavy" (kept by a selective region) is decided by the run time's own list:
    attention counted no FLOPs on CPU fake tensors, so the planner used to treat it as cheap
    while the region kept its output."""
    from fxopt.analysis.costmodel import node_costs

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.conv, self.bn, self.head = nn.Conv2d(3, 8, 3), nn.BatchNorm2d(8), nn.Linear(8, 4)

        def forward(self, x):
            y = self.bn(self.conv(x)).relu().mean((2, 3)).unsqueeze(1)
            return self.head(F.scaled_dot_product_attention(y, y, y).squeeze(1))

    gm = trace(Block(), torch.randn(2, 3, 8, 8))
    heavy = {n.name for n, cost in node_costs(gm, profile=False).items() if cost.heavy}
    assert heavy == {"conv", "scaled_dot_product_attention", "head"}
