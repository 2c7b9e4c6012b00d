"""What a script does to an optimized module's submodules takes effect as on the user's model, or
the call is refused before any compute (``fxopt.integrations.call_guard``).

A training script hooks submodules of whatever module it holds (feature extraction with
``model.layer4.register_forward_hook``, pruning and spectral norm's pre-hooks), swaps some
(LoRA adapters, quantization wrappers) and freezes some (BatchNorm in eval while the rest
trains). On the optimized module, all silently: a hook registered after ``optimize`` on a module
its graph runs inline never ran, one on a module a checkpointed region recomputes ran twice a
step, a replaced inlined module kept computing as the old one, and an export-captured
BatchNorm switched to eval kept normalizing with batch statistics. Hooks registered before
``optimize`` are planned for: the hooked module stays a call, outside every region, so its hooks
run once a step.
"""

from __future__ import annotations

import collections
import copy
import re

import pytest
import torch
import torchvision
from torch import nn

import fxopt
from fxopt import models_zoo
from fxopt.core import meta_keys
from fxopt.export import export, load_exported
from fxopt.graph.graphs import called_paths, recomputed_paths
from helpers import FailAt, grouped_query_llama, seeded

X = torch.randn(2, 3, 32, 32, generator=torch.Generator().manual_seed(0))

REGISTER = {
    "forward": lambda m, seen: m.register_forward_hook(lambda *a: seen.append(m)),
    "forward_pre": lambda m, seen: m.register_forward_pre_hook(lambda *a: seen.append(m)),
    "full_backward": lambda m, seen: m.register_full_backward_hook(lambda *a: seen.append(m)),
}


@pytest.fixture(scope="module")
def resnet():
    model = seeded(lambda: torchvision.models.resnet18(num_classes=10))
    return model, fxopt.optimize(model, X, verify=False, predict_memory=False)


@pytest.fixture(scope="module")
def unet():
    """The README's U-Net at budget 0.6: regions that recompute convolutions and BatchNorms."""
    model, inputs = models_zoo.build("unet")
    slim = fxopt.optimize(model, inputs, memory_budget=0.6, verify=False, predict_memory=False)
    return model, slim, inputs


def _buffers(module):
    return {k: v.clone() for k, v in module.named_buffers()}


@pytest.mark.parametrize("kind", list(REGISTER))
def test_a_hook_on_a_module_the_graph_runs_inline_is_refused_before_any_compute(resnet, kind):
    model, slim = resnet
    assert "layer4" not in called_paths(slim)
    seen: list = []
    for module in (slim, copy.deepcopy(slim)):
        handle = REGISTER[kind](module.layer4, seen)
        before = _buffers(module)
        with pytest.raises(fxopt.ConfigError, match="never calls it") as caught:
            module(X)
        assert caught.value.where == "layer4 (Sequential)"
        assert "before fxopt.optimize" in caught.value.hint
        assert all(torch.equal(v, before[k]) for k, v in module.named_buffers())  # no compute
        handle.remove()
    assert not seen
    for module in (model, slim):
        module.eval()
    try:
        with torch.no_grad():
            assert torch.equal(slim(X), model(X))  # removed, the module runs again
    finally:
        for module in (model, slim):
            module.train()


def test_a_hook_on_a_leaf_the_graph_calls_runs_once_and_changes_what_it_changes(resnet):
    model, slim = resnet
    assert "fc" in called_paths(slim)
    outputs = {}
    for name, module in (("model", model), ("slim", slim)):
        module.eval()
        calls: list = []
        handle = module.fc.register_forward_hook(lambda m, args, out: calls.append(m) or -out)
        try:
            with torch.no_grad():
                outputs[name] = module(X)
        finally:
            handle.remove()
            module.train()
        assert len(calls) == 1, name
    assert torch.equal(outputs["slim"], outputs["model"])


def test_an_export_captured_llama_refuses_a_hook_inside_a_block_and_runs_one_on_the_block():
    model = grouped_query_llama()
    ids = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(0))
    slim = fxopt.optimize(model, (), example_kwargs={"input_ids": ids}, verify=False,
                          predict_memory=False)
    assert "model.layers.0" in fxopt.blocks(slim)
    handle = slim.model.layers[0].mlp.register_forward_hook(lambda *a: None)
    with pytest.raises(fxopt.ConfigError, match="never calls it") as caught:
        slim(input_ids=ids)
    assert caught.value.where == "model.layers.0.mlp (LlamaMLP)"
    handle.remove()
    counts = collections.Counter()
    for name, module in (("model", model), ("slim", slim)):
        handle = module.model.layers[1].register_forward_pre_hook(
            lambda *a, name=name: counts.update([name]))
        module(input_ids=ids).logits.sum().backward()
        handle.remove()
    assert counts == {"model": 1, "slim": 1}


def test_a_hook_added_on_a_recomputed_module_is_refused_with_grad_and_runs_once_without(unet):
    model, slim, inputs = unet
    recomputed = recomputed_paths(slim)
    conv = next(p for p in sorted(recomputed) if isinstance(slim.get_submodule(p), nn.Conv2d))
    norm = next(p for p in sorted(recomputed)
                if isinstance(slim.get_submodule(p), nn.BatchNorm2d))
    calls: list = []
    for path, also in ((conv, "twice a step"), (norm, "BatchNorm")):
        handle = slim.get_submodule(path).register_forward_hook(lambda *a: calls.append(1))
        with pytest.raises(fxopt.ConfigError, match="recomputes it in backward") as caught:
            slim(*inputs)
        assert also in str(caught.value) and caught.value.where.startswith(path + " ")
        assert not calls
        with torch.no_grad():
            slim(*inputs)  # nothing is recomputed: the hook runs once, as on the model
        assert len(calls) == 1
        calls.clear()
        handle.remove()


def test_hooks_registered_before_optimize_run_once_a_step_and_stay_out_of_regions():
    """A counting hook on a convolution and a BatchNorm hook that changes its output, both on
    modules the U-Net's 0.7 plan recomputes when they have no hooks: the plan leaves them out
    of its regions, verification passes (before, the BatchNorm's recomputation skipped the hook,
    and the gradients were another function's), and each hook runs once a step."""
    model, inputs = models_zoo.build("unet")
    hookless = fxopt.optimize(copy.deepcopy(model), inputs, memory_budget=0.7, verify=False,
                              predict_memory=False)
    recomputed = recomputed_paths(hookless)
    conv = next(p for p in sorted(recomputed) if isinstance(model.get_submodule(p), nn.Conv2d))
    norm = next(p for p in sorted(recomputed)
                if isinstance(model.get_submodule(p), nn.BatchNorm2d))
    calls = collections.Counter()
    model.get_submodule(conv).register_forward_hook(lambda *a: calls.update(["conv"]))
    model.get_submodule(norm).register_forward_hook(
        lambda m, args, out: calls.update(["norm"]) or out * 2)
    reference = copy.deepcopy(model)
    slim = fxopt.optimize(model, inputs, memory_budget=0.7)  # verified
    assert not {conv, norm} & recomputed_paths(slim) and recomputed_paths(slim)
    losses = {}
    for name, module in (("reference", reference), ("slim", slim)):
        calls.clear()
        loss = module(*inputs).square().mean()
        loss.backward()
        assert calls == {"conv": 1, "norm": 1}, (name, calls)
        losses[name] = loss.item()
    assert losses["slim"] == pytest.approx(losses["reference"], rel=1e-6)
    for (name, p), q in zip(reference.named_parameters(), slim.parameters()):
        torch.testing.assert_close(q.grad, p.grad, rtol=1e-4, atol=1e-6, msg=name)


def test_a_module_replaced_where_the_graph_runs_it_inline_is_refused_and_a_called_one_runs():
    """A Hugging Face Llama captured by torch.export: an MLP projection swapped for a subclass
    (what an adapter does) used to be ignored, its parameters read by name; a block, which the
    graph calls, swapped for a copy of itself runs as the model does."""
    model = grouped_query_llama()
    ids = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(1))
    slim = fxopt.optimize(model, (), example_kwargs={"input_ids": ids}, verify=False,
                          predict_memory=False)

    class Scaled(nn.Linear):  # an adapter: the projection plus something of its own
        def forward(self, x):
            return 2 * super().forward(x)

    mlp = slim.model.layers[0].mlp
    original = mlp.down_proj
    replaced = Scaled(original.in_features, original.out_features, bias=False)
    replaced.weight = original.weight
    mlp.down_proj = replaced
    with pytest.raises(fxopt.ConfigError, match="where fxopt.optimize saw a Linear") as caught:
        slim(input_ids=ids)
    assert caught.value.where == "model.layers.0.mlp.down_proj (Linear)"
    assert "before fxopt.optimize" in caught.value.hint
    mlp.down_proj = original
    for module in (model, slim):
        module.model.layers[1] = copy.deepcopy(module.model.layers[1])
    torch.testing.assert_close(slim(input_ids=ids).logits, model(input_ids=ids).logits)


@pytest.mark.parametrize("capture", ["fx", "export"])
def test_a_batch_norm_frozen_after_optimize_is_frozen_or_refused(capture):
    """torch.export lowers BatchNorm into the graph in the mode of the graph that runs it (the
    root's, or a kept block's): a BatchNorm frozen in eval inside a block that trains used to
    keep normalizing with batch statistics and updating its running ones; now the call is
    refused. A whole block frozen runs its eval-mode graph: it trains as the user's model does.
    Symbolic tracing calls BatchNorm as a module, which reads its own flag: frozen there, it
    trains as the user's model does."""
    model = seeded(lambda: torchvision.models.resnet18(num_classes=10))
    slim = fxopt.optimize(model, X, capture=capture, verify=False, predict_memory=False)
    reference = copy.deepcopy(model)
    for module in (reference, slim):
        module.layer1[0].bn1.eval()
    if capture == "export":
        before = _buffers(slim)
        with pytest.raises(fxopt.ConfigError, match="in eval mode while layer1.0, a block the "
                                                    "optimized graph calls, is in train mode"
                           ) as caught:
            slim(X)
        assert caught.value.where == "layer1.0.bn1 (BatchNorm2d)"
        assert "capture='fx'" in caught.value.hint
        assert all(torch.equal(v, before[k]) for k, v in slim.named_buffers())
        assert "layer1.0" in fxopt.blocks(slim)
        for module in (reference, slim):
            module.layer1[0].eval()  # the whole block: its eval-mode graph runs
    torch.testing.assert_close(slim(X), reference(X))
    for (name, a), b in zip(reference.named_buffers(), slim.buffers()):
        torch.testing.assert_close(b, a, msg=name)


def test_dropout_switched_on_in_eval_is_refused_where_the_graph_runs_it_inline():
    """Monte Carlo dropout (the module in eval, its dropouts in train) on a GPT-2 captured by
    torch.export: the eval-mode graph has no dropout, so it used to give the plain eval output."""
    transformers = pytest.importorskip("transformers")
    model = seeded(transformers.GPT2LMHeadModel, transformers.GPT2Config(
        vocab_size=64, n_positions=32, n_embd=32, n_layer=1, n_head=2, use_cache=False,
        bos_token_id=0, eos_token_id=0))
    ids = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(2))
    slim = fxopt.optimize(model, (), example_kwargs={"input_ids": ids}, verify=False,
                          predict_memory=False)
    slim.eval()
    drop = next(p for p, m in slim.named_modules() if isinstance(m, nn.Dropout) and m.p > 0)
    slim.get_submodule(drop).train()
    with torch.no_grad(), pytest.raises(fxopt.ConfigError, match="in train mode while the "
                                                                 "module is in eval mode"):
        slim(input_ids=ids)


@pytest.mark.parametrize("capture", ["fx", "export"])
def test_a_norms_momentum_set_after_optimize_takes_effect_or_is_refused(capture):
    """torch.export builds BatchNorm's momentum into the graph: set anew after ``optimize`` it
    used to be ignored (the running statistics moved by the old one); now the call is refused.
    A BatchNorm symbolic tracing calls reads its own."""
    model = seeded(lambda: torchvision.models.resnet18(num_classes=10))
    slim = fxopt.optimize(model, X, capture=capture, verify=False, predict_memory=False)
    reference = copy.deepcopy(model)
    for module in (reference, slim):
        module.layer2[0].bn2.momentum = 0.5
    if capture == "export":
        with pytest.raises(fxopt.ConfigError, match="momentum is 0.5 now, where "
                                                    "fxopt.optimize saw 0.1") as caught:
            slim(X)
        assert caught.value.where == "layer2.0.bn2 (BatchNorm2d)"
        slim.layer2[0].bn2.momentum = 0.1
        slim(X)
        return
    slim(X), reference(X)
    for (name, a), b in zip(reference.named_buffers(), slim.buffers()):
        torch.testing.assert_close(b, a, msg=name)


@pytest.mark.parametrize("capture", ["fx", "export"])
def test_swa_update_bn_recomputes_statistics_as_on_the_model_or_says_how(capture):
    """``torch.optim.swa_utils.update_bn`` resets every BatchNorm's statistics, sets its momentum
    to None (a cumulative average) and runs a pass over data. A graph that calls BatchNorm as a
    module (symbolic tracing) computes the model's statistics; one that runs it inline with its
    momentum built in (torch.export) refuses the pass, saying to run it on the model or to
    capture with ``capture='fx'``."""
    model = seeded(lambda: torchvision.models.resnet18(num_classes=10))
    slim = fxopt.optimize(model, X, capture=capture, memory_budget="min", verify=False,
                          predict_memory=False)
    averaged = [torch.optim.swa_utils.AveragedModel(m) for m in (copy.deepcopy(model), slim)]
    batches = [X, X * 0.5]
    torch.optim.swa_utils.update_bn(batches, averaged[0])
    if capture == "export":
        with pytest.raises(fxopt.ConfigError, match="momentum is None now") as caught:
            torch.optim.swa_utils.update_bn(batches, averaged[1])
        assert "swa_utils.update_bn" in caught.value.hint and "capture='fx'" in caught.value.hint
        return
    torch.optim.swa_utils.update_bn(batches, averaged[1])
    for (name, a), b in zip(averaged[0].named_buffers(), averaged[1].buffers()):
        torch.testing.assert_close(b, a, msg=name)


class Scaled(nn.Module):
    """A module of the user's own class whose forward reads three plain attributes: a scale, a
    flag it branches on and a list of two weights."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(8, 8)
        self.scale, self.gated, self.mix = 0.5, True, [1.0, 0.0]

    def forward(self, x):
        y = self.fc(x) * self.scale * self.mix[0] + self.mix[1]
        return y * torch.sigmoid(y) if self.gated else y


class TwoScaled(nn.Module):
    """Two repeated blocks (kept as calls) and a third Scaled the graph runs inline."""

    def __init__(self):
        super().__init__()
        self.body = nn.Sequential(Scaled(), Scaled())
        self.gate = Scaled()
        self.head = nn.Linear(8, 2)

    def forward(self, x):
        return self.head(self.gate(self.body(x)))


@pytest.mark.parametrize("capture", ["fx", "export"])
def test_a_scale_or_flag_set_after_optimize_on_a_module_of_the_users_class_is_refused(capture):
    """Both captures build into the graph what ``forward`` read off ``self`` (the scale, the
    branch taken): set anew or deleted after ``optimize``, it used to be ignored; now the call is
    refused before any compute, and set back the module computes the model's function again;
    on a module the graph runs inline and on a block it calls (a GraphModule, which holds the
    attributes as the user's module did). An attribute added after ``optimize`` (a tag a script
    hangs on a module) is accepted: the forward captured did not read it."""
    model = seeded(TwoScaled)
    x = torch.randn(4, 8, generator=torch.Generator().manual_seed(0))
    slim = fxopt.optimize(model, x, capture=capture, verify=False, predict_memory=False)
    assert fxopt.blocks(slim) == ["body.0", "body.1"]
    assert (slim.body[1].scale, slim.body[1].gated) == (0.5, True)
    changes = [("body.1", "scale", 2.0, "scale is 2.0 now, where fxopt.optimize saw 0.5"),
               ("gate", "gated", False, "gated is False now, where fxopt.optimize saw True"),
               ("gate", "scale", None, "scale is not set now, where fxopt.optimize saw 0.5"),
               ("body.0", "gated", None, "gated is not set now, where fxopt.optimize saw True")]
    for path, name, value, message in changes:
        module = slim.get_submodule(path)
        was = getattr(module, name)
        if value is None:
            delattr(module, name)
        else:
            setattr(module, name, value)
        with pytest.raises(fxopt.ConfigError, match=message) as caught:
            slim(x)
        assert caught.value.where == f"{path} (Scaled)"
        assert f"set it back to {was!r}" in caught.value.hint
        setattr(module, name, was)
    for path in ("body.1", "gate"):  # a list changed in place: no setattr to see
        module, own = slim.get_submodule(path), model.get_submodule(path)
        assert module.mix == own.mix and module.mix is not own.mix
        module.mix[0] = 3.0
        with pytest.raises(fxopt.ConfigError, match=re.escape(
                "mix is [3.0, 0.0] now, where fxopt.optimize saw [1.0, 0.0]")) as caught:
            slim(x)
        assert caught.value.where == f"{path} (Scaled)"
        module.mix[0] = 1.0
    slim.body[0].note = slim.gate.note = "tagged"
    copied = copy.deepcopy(slim)
    torch.testing.assert_close(slim(x), model(x))
    copied.body[1].scale = 2.0
    with pytest.raises(fxopt.ConfigError, match="body.1.scale is 2.0 now"):
        copied(x)


class ScaledRoot(nn.Module):
    """A root whose forward reads a scale and a flag of its own."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(8, 8)
        self.temperature, self.centred, self.tags = 2.0, True, ["kept by reference"]

    def forward(self, x):
        y = self.fc(x) / self.temperature
        return y - y.mean() if self.centred else y


@pytest.mark.parametrize("capture", ["fx", "export"])
def test_a_scalar_attribute_of_the_root_reads_as_on_the_model_and_set_anew_is_refused(
        capture, tmp_path):
    """The optimized module stands for the user's root: what a script reads off the model
    (``model.temperature``) it used to answer with an AttributeError, and what a script set on
    it (``model.temperature = 0.5``) changed the model's results and silently not the graph's,
    which has the value forward read built in. The root's scalar attributes are now the
    optimized module's too, and one set anew or deleted is refused before any compute, on a
    deep copy and after torch.save / torch.load alike; an attribute added is accepted. A list of
    scalars is carried as a copy of its own, and changed in place (which no setattr shows) it
    is refused alike; the model changing its own list leaves the optimized module's as it was.
    The saved module is a deep copy:
    torch.load of one made by torch.export raised NotImplementedError (the copy re-traced with
    fx's own tracer, which cannot record the input guard), until the tracer class went with the
    graph, where GraphModule's copies take it from."""
    model = seeded(ScaledRoot)
    x = torch.randn(4, 8, generator=torch.Generator().manual_seed(0))
    slim = fxopt.optimize(model, x, capture=capture, verify=False, predict_memory=False)
    assert (slim.temperature, slim.centred) == (2.0, True)
    assert slim.tags == model.tags and slim.tags is not model.tags
    model.tags.append("the model's own")
    assert slim.tags == ["kept by reference"]
    slim.epoch = 3
    torch.testing.assert_close(slim(x), model(x))
    torch.save(copy.deepcopy(slim), tmp_path / "slim.pt")
    loaded = torch.load(tmp_path / "slim.pt", weights_only=False)
    for optimized in (slim, copy.deepcopy(slim), loaded):
        for name, value, message in [("temperature", 0.5, "temperature is 0.5 now, where "
                                                          "fxopt.optimize saw 2.0"),
                                     ("centred", None, "centred is not set now")]:
            was = getattr(optimized, name)
            if value is None:
                delattr(optimized, name)
            else:
                setattr(optimized, name, value)
            with FailAt() as ops, pytest.raises(fxopt.ConfigError, match=message) as caught:
                optimized(x)
            assert ops.calls == 0 and caught.value.where == name
            setattr(optimized, name, was)
        optimized.tags[0] = "changed in place"
        with FailAt() as ops, pytest.raises(fxopt.ConfigError, match=re.escape(
                "tags is ['changed in place'] now, where fxopt.optimize saw "
                "['kept by reference']")) as caught:
            optimized(x)
        assert ops.calls == 0 and caught.value.where == "tags"
        optimized.tags[0] = "kept by reference"
        torch.testing.assert_close(optimized(x), model(x))


class Doubling(nn.Module):
    """A module of the user's class whose forward reads ``self.training``."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(8, 8)

    def forward(self, x):
        y = self.fc(x)
        return y * 2.0 if self.training else y


class DoublingBlock(nn.Module):
    def __init__(self):
        super().__init__()
        self.doubling, self.fc = Doubling(), nn.Linear(8, 8)

    def forward(self, x):
        return x + self.fc(self.doubling(x))


class Moded(nn.Module):
    """Two blocks (kept as calls) that hold a Doubling each, and a Doubling the root's graph runs
    inline."""

    def __init__(self):
        super().__init__()
        self.body = nn.Sequential(DoublingBlock(), DoublingBlock())
        self.gate, self.head = Doubling(), nn.Linear(8, 2)

    def forward(self, x):
        return self.head(self.gate(self.body(x)))


@pytest.mark.parametrize("capture", ["fx", "export"])
def test_a_module_of_the_users_class_in_another_mode_computes_as_its_mode_or_is_refused(capture):
    """Both captures trace forward in train mode and in eval mode, each with every module in
    that mode; a module the graph runs inline runs as in the mode of the graph that runs it (the
    root's, or a kept block's). One of the user's class whose forward reads ``self.training``,
    switched to another mode after ``optimize``, used to compute as in the graph's mode; now the
    call is refused. The capture lists which modules compute differently in the two modes
    (``TraceInfo.mode_dependent_modules``): switching any other (a Linear, a Sequential of
    blocks, a whole block, which runs its own eval-mode graph) computes as on the user's model,
    and a module kept as a call (``leaf_modules``) runs in its own mode."""
    model = seeded(Moded)
    x = torch.randn(4, 8, generator=torch.Generator().manual_seed(0))
    slim = fxopt.optimize(model, x, capture=capture, verify=False, predict_memory=False)
    assert fxopt.blocks(slim) == ["body.0", "body.1"]
    assert slim.fxopt_report.trace.mode_dependent_modules == (
        "body.0.doubling", "body.1.doubling", "gate")
    reference = copy.deepcopy(model)
    for path in ("head", "body.0.fc", "body.1", "body"):
        for module in (reference, slim):
            module.train()
            module.get_submodule(path).eval()
        torch.testing.assert_close(slim(x), reference(x), msg=path)
    refusals = [("gate", "while the module is in train mode"),
                ("body.0.doubling", "while body.0, a block the optimized graph calls, is in "
                                    "train mode")]
    for path, message in refusals:
        slim.train()
        slim.get_submodule(path).eval()
        with pytest.raises(fxopt.ConfigError, match=message) as caught:
            slim(x)
        assert caught.value.where == f"{path} (Doubling)"
        assert "reads self.training" in str(caught.value)
        assert f"leaf_modules=('{path}',)" in caught.value.hint
    slim.eval()
    slim.gate.train()
    with torch.no_grad(), pytest.raises(fxopt.ConfigError, match="gate .* in train mode while"):
        slim(x)
    kept = fxopt.optimize(model, x, capture=capture, leaf_modules=("gate",), verify=False,
                          predict_memory=False)
    for module in (reference, kept):
        module.train()
        module.gate.eval()
    torch.testing.assert_close(kept(x), reference(x))


def test_modes_change_what_their_own_operations_or_their_calls_do():
    """``modules_the_mode_changes`` on two tiny graphs per case: a module's own operations, the
    submodules it runs, and a dropout that drops nothing (one computation in either mode)."""
    from fxopt.graph.train_eval import modules_the_mode_changes

    class Choosing(nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b, self.off = nn.Linear(4, 4), nn.Linear(4, 4), nn.Dropout(0.0)

        def forward(self, x):
            return self.off(self.a(x) if self.training else self.b(x))

    class Outer(nn.Module):
        def __init__(self):
            super().__init__()
            self.choosing, self.plain, self.doubling = Choosing(), nn.Linear(4, 4), Doubling()
            self.doubling.fc = nn.Linear(4, 4)

        def forward(self, x):
            return self.doubling(self.plain(self.choosing(x)))

    class InlineAll(torch.fx.Tracer):
        def is_leaf_module(self, m, name):
            return False

    model = Outer()
    graphs = [InlineAll().trace(model.train(mode)) for mode in (True, False)]
    assert modules_the_mode_changes(*graphs) == ("choosing", "choosing.a", "choosing.b",
                                                 "doubling")
    assert modules_the_mode_changes(graphs[0], graphs[0]) == ()


class Branching(nn.Module):
    """Data-dependent control flow: symbolic tracing keeps it as an opaque leaf, a call."""

    def __init__(self):
        super().__init__()
        self.inner, self.drop = nn.Linear(8, 8), nn.Dropout(0.0)

    def forward(self, x):
        y = self.drop(self.inner(x))
        return torch.tanh(y) if y.sum() > 0 else y


class WithOpaqueLeaf(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc, self.leaf, self.head = nn.Linear(8, 8), Branching(), nn.Linear(8, 2)

    def forward(self, x):
        return self.head(self.leaf(torch.relu(self.fc(x))))


def test_what_a_script_does_inside_an_opaque_leaf_takes_effect_as_on_the_model():
    """A module torch.fx cannot trace is kept as a call: its own forward calls its submodules,
    so a hook on one of them runs, and a submodule replaced or a constant set there takes
    effect, as on the user's model. The guard used to refuse each as if the graph ran them
    inline."""
    model = seeded(WithOpaqueLeaf)
    x = torch.randn(4, 8, generator=torch.Generator().manual_seed(0))
    slim = fxopt.optimize(model, x, capture="fx", verify=False, predict_memory=False)
    assert [leaf.path for leaf in slim.fxopt_report.trace.leaves] == ["leaf"]
    reference = copy.deepcopy(model)
    seen = []
    for module in (reference, slim):
        module.leaf.inner.register_forward_hook(lambda m, a, out: seen.append(out.shape))
    torch.testing.assert_close(slim(x), reference(x))
    assert len(seen) == 2
    replacement = seeded(lambda: nn.Linear(8, 8))
    for module in (reference, slim):
        module.leaf.inner = copy.deepcopy(replacement)
        module.leaf.drop.p = 0.5
        module.eval()
    torch.testing.assert_close(slim(x), reference(x))


def _doubled(module, args, output):
    return output * 2


@pytest.mark.parametrize("capture", ["fx", "export"])
def test_torch_load_keeps_the_optimized_modules_hooks_mode_and_guard(capture, tmp_path):
    """torch.fx's loading rebuilds a GraphModule from its code and dropped what every module has
    anew: the loaded module ran without the user's forward hook (another function), in train
    mode whatever it was saved in, and without the call guard, so a hook or a constant set
    afterwards on a module the graph runs inline was silently ignored. Loaded now, it computes
    the model's function in the mode it was saved in, and refuses as the saved one does.
    (torch.export refuses a model with hooks: the hook is the symbolic-tracing path's.)"""
    model = seeded(TwoScaled)
    if capture == "fx":
        model.register_forward_hook(_doubled)
    x = torch.randn(4, 8, generator=torch.Generator().manual_seed(0))
    slim = fxopt.optimize(model, x, capture=capture, verify=False, predict_memory=False)
    slim.eval()
    torch.save(slim, tmp_path / "slim.pt")
    loaded = torch.load(tmp_path / "slim.pt", weights_only=False)
    assert not loaded.training and loaded.body[1].scale == 0.5
    model.eval()
    with torch.no_grad():
        torch.testing.assert_close(loaded(x), model(x))
    handle = loaded.gate.register_forward_hook(_doubled)
    with pytest.raises(fxopt.ConfigError, match="never calls it"):
        loaded(x)
    handle.remove()
    for module in (loaded.gate, loaded.body[1]):
        module.scale = 2.0
        with pytest.raises(fxopt.ConfigError, match="scale is 2.0 now"):
            loaded(x)
        module.scale = 0.5
    again = torch.load(_saved(loaded, tmp_path), weights_only=False)  # a loaded one saves too
    with torch.no_grad():
        torch.testing.assert_close(again(x), model(x))


def _saved(module, folder):
    path = folder / "again.pt"
    torch.save(module, path)
    return path


def test_an_attention_scaling_set_after_optimize_is_refused_on_an_export_captured_llama():
    """A Hugging Face attention's ``scaling`` (a float the exported graph multiplies by) set
    anew: refused, naming the layer."""
    model = grouped_query_llama()
    ids = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(0))
    slim = fxopt.optimize(model, (), example_kwargs={"input_ids": ids}, verify=False,
                          predict_memory=False)
    attention = slim.model.layers[1].self_attn
    attention.scaling = 1.0
    with pytest.raises(fxopt.ConfigError, match="scaling is 1.0 now") as caught:
        slim(input_ids=ids)
    assert caught.value.where == "model.layers.1.self_attn (LlamaAttention)"


def test_under_torch_compile_the_guard_compiles_once_and_still_refuses_a_later_hook(resnet):
    """torch.compile traces the guard (dynamo guards on what it read): steady calls compile
    nothing more, and a hook registered afterwards recompiles it, which refuses the call."""
    from torch._dynamo.utils import counters

    _, slim = resnet
    torch.compiler.reset()
    compiled = torch.compile(slim, backend="aot_eager")
    try:
        compiled(X).sum().backward()
        graphs = counters["stats"]["unique_graphs"]
        for _ in range(3):
            compiled(X).sum().backward()
        assert counters["stats"]["unique_graphs"] == graphs
        handle = slim.layer4.register_forward_hook(lambda *a: None)
        try:
            with pytest.raises(fxopt.ConfigError, match="never calls it"):
                compiled(X)
        finally:
            handle.remove()
    finally:
        for p in slim.parameters():
            p.grad = None
        torch.compiler.reset()


def test_the_guard_checks_in_full_only_after_something_it_watches_changed(monkeypatch):
    """Each call used to walk the whole module tree (x1.047 on the zoo's grouped CNN at a
    tiny batch, where a CPU step is dispatch-bound as small GPU kernels are launch-bound: issue
    32's line is 2%). Now a call compares the modules the check depends on with what it last
    found (none on this CNN, whose graph calls every module) and runs the whole check only
    when one changed, or in a mode or grad mode not checked before; what it must refuse, it
    still refuses on the next call."""
    import sys

    from fxopt.integrations import call_guard

    model, inputs = models_zoo.build("grouped_cnn", 4)
    slim = fxopt.optimize(model, inputs, memory_budget=1.0, verify=False, predict_memory=False)
    full = []
    real = call_guard._refuse_changed_modules
    monkeypatch.setattr(call_guard, "_refuse_changed_modules",
                        lambda *args: full.append(1) or real(*args))
    for _ in range(3):
        slim(*inputs)
    assert len(full) == 1
    with torch.no_grad():
        slim(*inputs)
        slim(*inputs)
    assert len(full) == 2  # another grad mode: checked once

    calls = []

    def count(frame, event, arg):
        if event == "call":
            calls.append(frame.f_code.co_name)

    sys.setprofile(count)
    try:
        call_guard.refuse_what_would_not_run(slim, inputs)
    finally:
        sys.setprofile(None)
    assert calls == ["refuse_what_would_not_run", "still_as_they_were"], calls

    unet, x = models_zoo.build("unet", 2)  # its graph runs containers inline: watched
    slim = fxopt.optimize(unet, x, memory_budget=1.0, verify=False, predict_memory=False)
    slim(*x)
    inlined = slim.meta[meta_keys.INLINED][0][0]
    handle = slim.get_submodule(inlined).register_forward_hook(lambda *args: None)
    with pytest.raises(fxopt.ConfigError, match="never calls it"):
        slim(*x)
    handle.remove()
    slim(*x)


@pytest.mark.parametrize("capture", ["fx", "export"])
def test_a_bias_set_to_none_after_optimize_computes_as_the_model_or_is_refused(capture, tmp_path):
    """``layer.bias = None`` (a script dropping a bias it will not train): a graph that calls the
    Linear computes as the model does without it; one torch.export captured reads the bias
    itself, and its input guard raised a raw AttributeError reading the None's dtype. Now: an
    fxopt ConfigError naming the parameter before any compute, from the optimized module and
    from the folder ``fxopt.export`` wrote alike."""
    model = seeded(TwoScaled)
    x = torch.randn(4, 8, generator=torch.Generator().manual_seed(0))
    slim = fxopt.optimize(model, x, capture=capture, verify=False, predict_memory=False)
    export(slim, tmp_path / "out", example_inputs=(x,))
    exported = load_exported(tmp_path / "out").load()
    model.head.bias = None
    for module in (slim, exported):
        module.head.bias = None
        if capture == "fx":
            torch.testing.assert_close(module(x), model(x))
            continue
        with FailAt() as ops, pytest.raises(Exception, match="head.bias is None now") as caught:
            module(x)
        assert ops.calls == 0 and type(caught.value).__name__ == "ConfigError"
        assert "head.bias" in caught.value.where
