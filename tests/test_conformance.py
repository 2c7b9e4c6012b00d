"""The optimized module and the user's module are interchangeable in a training script.

For each model (a Hugging Face causal LM and an encoder classifier, captured by torch.export; a
CNN with BatchNorm, captured by symbolic tracing and by torch.export) and each pipeline (the
default, ``memory_budget="min"``), every operation a training script applies to a module is
applied to the user's model and to the optimized one alike; then one training step of each must
give the same loss and the same gradient for every parameter (float tolerance), and the same
BatchNorm buffers, and a forward without grad the same loss (under ``"min"`` that runs the
checkpointed regions' boxed code, which frees each input at its last use). An error half-way
through a forward, with or without grad, leaves nothing behind. An operation fxopt does not
serve must raise an ``FxoptError`` before any compute instead (the test names which: a dtype
change of an export-captured module).
"""

from __future__ import annotations

import copy
import io

import pytest
import torch
from torch import nn

import fxopt
from helpers import FailAt, Injected
from fxopt.core import meta_keys
from fxopt.core.errors import InputError
from fxopt.core.torch_private import forward_pre_hooks
from fxopt.integrations.call_guard import refuse_what_would_not_run
from fxopt.integrations.hf_trainer import PretrainedInterface
from fxopt.runtime.regions import CheckpointedRegion

transformers = pytest.importorskip("transformers")


class ConvBN(nn.Module):
    def __init__(self):
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU())
        self.block = nn.Sequential(nn.Conv2d(8, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(),
                                   nn.Conv2d(8, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU())
        self.head = nn.Linear(8, 5)
        self.scale = 1.0  # a scalar of the root's own, which the graph has built in

    def forward(self, x):
        return self.head(self.block(self.stem(x)).mean((2, 3))) * self.scale


def _llama():
    config = transformers.LlamaConfig(
        vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256, use_cache=False)
    ids = torch.randint(0, 256, (2, 32), generator=torch.Generator().manual_seed(1))
    return transformers.LlamaForCausalLM(config), {"input_ids": ids, "labels": ids}


def _bert():
    config = transformers.BertConfig(
        vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, max_position_embeddings=256, num_labels=3,
        hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
    ids = torch.randint(0, 256, (2, 32), generator=torch.Generator().manual_seed(2))
    return (transformers.BertForSequenceClassification(config),
            {"input_ids": ids, "labels": torch.tensor([0, 2])})


def _cnn():
    return ConvBN(), {"x": torch.randn(2, 3, 16, 16, generator=torch.Generator().manual_seed(3))}


MODELS = {"llama": (_llama, "auto"), "bert": (_bert, "auto"),
          "cnn-fx": (_cnn, "fx"), "cnn-export": (_cnn, "export")}
PIPELINES = {"default": {}, "min": {"memory_budget": "min"}}


_CAPTURED: dict[str, tuple] = {}


def _captured(name: str) -> tuple:
    """(user's model, inputs, its capture): one per model, which both pipelines start from
    (``optimize(captured=...)``, proven equal to a fresh capture in tests/test_captured.py)."""
    if name not in _CAPTURED:
        build, capture = MODELS[name]
        torch.manual_seed(0)
        model, inputs = build()
        model.train()
        args, kwargs = ((inputs["x"],), None) if name.startswith("cnn") else ((), inputs)
        _CAPTURED[name] = (model, inputs, fxopt.capture_model(model, args, example_kwargs=kwargs,
                                                              capture=capture))
    return _CAPTURED[name]


@pytest.fixture(scope="module", params=[(m, p) for m in MODELS for p in PIPELINES],
                ids=lambda mp: f"{mp[0]}-{mp[1]}")
def pair(request):
    """(user's model, optimized module, inputs): built once per model and pipeline, both
    pipelines of a model from one capture of it."""
    name, pipeline = request.param
    model, inputs, captured = _captured(name)
    if name.startswith("cnn"):
        slim = fxopt.optimize(model, (inputs["x"],), captured=captured, **PIPELINES[pipeline])
    else:
        slim = fxopt.optimize(model, (), example_kwargs=inputs, captured=captured,
                              **PIPELINES[pipeline])
    if pipeline == "min":
        assert any(type(v).__name__ == "CheckpointedRegion"
                   for m in slim.modules() for v in vars(m).values())
    return model, slim, inputs


def _loss(output):
    if isinstance(output, torch.Tensor):
        return output.square().mean()
    return output["loss"]


def _step(module, inputs):
    """Loss, gradients by parameter name, buffers by name after one training step."""
    module.zero_grad(set_to_none=True)
    torch.manual_seed(0)
    loss = _loss(module(**inputs))
    loss.backward()
    grads = {n: p.grad for n, p in module.named_parameters() if p.grad is not None}
    return loss.detach(), grads, {n: b.clone() for n, b in module.named_buffers()}


def _loss_without_grad(module, inputs):
    torch.manual_seed(0)
    with torch.no_grad():
        return _loss(module(**inputs))


def _assert_same_step(slim, model, inputs, *, rtol=1e-5, atol=1e-6):
    torch.testing.assert_close(_loss_without_grad(slim, inputs), _loss_without_grad(model, inputs),
                               rtol=rtol, atol=atol, msg=lambda m: f"without grad: {m}")
    loss, grads, buffers = _step(slim, inputs)
    ref_loss, ref_grads, ref_buffers = _step(model, inputs)
    torch.testing.assert_close(loss, ref_loss, rtol=rtol, atol=atol)
    assert grads.keys() == ref_grads.keys()
    for name, grad in grads.items():
        scale = ref_grads[name].abs().max().item()
        torch.testing.assert_close(grad, ref_grads[name], rtol=rtol, atol=atol + rtol * scale,
                                   msg=lambda m, name=name: f"grad of {name}: {m}")
    for name, buffer in buffers.items():
        torch.testing.assert_close(buffer, ref_buffers[name], rtol=rtol, atol=atol, msg=name)


def _copies(pair):
    """Independent copies of the user's model and the optimized module (sharing nothing)."""
    model, slim, inputs = pair
    return copy.deepcopy(model), copy.deepcopy(slim), inputs


def _new_state(model):
    generator = torch.Generator().manual_seed(7)
    return {k: (torch.randn(v.shape, generator=generator, dtype=v.dtype) * 0.05
                if v.is_floating_point() else v.clone())
            for k, v in model.state_dict().items()}


def test_optimized_module_shares_the_users_parameters(pair):
    model, slim, _ = pair
    ours = dict(slim.named_parameters())
    assert all(ours[n] is p for n, p in model.named_parameters())
    assert slim.state_dict().keys() == model.state_dict().keys()


def test_deepcopy(pair):
    model, slim, inputs = _copies(pair)
    assert not set(map(id, slim.parameters())) & set(map(id, pair[0].parameters()))
    _assert_same_step(slim, model, inputs)


def test_recompile(pair):
    """``recompile()``, as torch.fx passes and users call it: the optimized Hugging Face model's
    class (its own, beside torch.fx's per-instance one) used to call itself for ever after it."""
    model, slim, inputs = pair  # slim itself: a deep copy's class is torch.fx's alone
    reference, before = copy.deepcopy(model), copy.deepcopy(slim.state_dict())
    slim.recompile()
    try:
        _assert_same_step(slim, reference, inputs)
    finally:  # the step moved the BatchNorm statistics slim shares with the fixture's model
        slim.load_state_dict(before)
        for p in slim.parameters():
            p.grad = None


def _guards(module) -> int:
    return forward_pre_hooks(module).count(refuse_what_would_not_run)


def test_the_call_guard_is_the_one_piece_of_state_fxopt_adds_and_every_operation_keeps_it(pair):
    """The root's forward pre-hook (``fxopt.integrations.call_guard``) holds nothing (a module-level
    function reading the module it is called with): deepcopy, load_state_dict with assign, a
    dtype or device move and a replaced Parameter keep exactly one; optimizing the optimized
    module again does not add a second. FSDP2's parameter swap: tests/test_fsdp.py, where every
    fxopt arm runs it."""
    model, slim, inputs = _copies(pair)
    assert _guards(pair[1]) == 1 and _guards(pair[0]) == 0
    slim.load_state_dict(_new_state(model), assign=True)
    slim.to(torch.float64).to("cpu")
    name, param = next(iter(slim.named_parameters()))
    owner, _, attr = name.rpartition(".")
    setattr(slim.get_submodule(owner), attr, nn.Parameter(param.detach().clone()))
    assert _guards(slim) == 1 and _guards(copy.deepcopy(slim)) == 1


def test_after_every_operation_the_call_guard_still_refuses_what_would_not_run(pair):
    """The guard's record (``meta[INLINED]``: the modules the graphs run inline) survives what a
    script does to the module: after load_state_dict with assign, a dtype round trip and a
    deepcopy, a hook on an inlined module, a replaced inlined module, (on a capture that
    inlines BatchNorm) a BatchNorm in another mode than the root, a scalar attribute of the
    root's set anew and (on a Hugging Face model) a config field the forward reads are each
    refused before any compute, and the module runs again once they are undone."""
    model, slim, inputs = _copies(pair)
    slim.load_state_dict(_new_state(model), assign=True)
    slim.to(torch.float64).to(torch.float32)
    slim = copy.deepcopy(slim)
    inlined = [path for path, *_ in slim.meta[meta_keys.INLINED]]
    path = inlined[-1]
    owner, _, attr = path.rpartition(".")
    parent, module = slim.get_submodule(owner), slim.get_submodule(path)
    buffers = {k: v.clone() for k, v in slim.named_buffers()}

    def refused(match: str) -> None:
        with pytest.raises(fxopt.ConfigError, match=match):
            slim(**inputs)
        assert all(torch.equal(v, buffers[k]) for k, v in slim.named_buffers())

    handle = module.register_forward_hook(lambda *args: None)
    refused("never calls it")
    handle.remove()
    setattr(parent, attr, nn.Identity())
    refused("now, where fxopt.optimize saw")
    setattr(parent, attr, module)
    norms = [p for p in inlined if isinstance(slim.get_submodule(p), nn.BatchNorm2d)]
    if norms:
        slim.get_submodule(norms[0]).eval()
        refused("in eval mode while the module is in train mode")
        slim.get_submodule(norms[0]).train()
    # the root's scalar attributes (held by the module itself) and a Hugging Face config
    constants = slim.meta[meta_keys.BLOCK_CONSTANTS]
    name = next(n for n, v in constants.items() if type(v) in (int, float))
    was = getattr(slim, name)
    setattr(slim, name, was + 1)
    refused(f"{name} is {was + 1!r} now, where fxopt.optimize saw {was!r}")
    setattr(slim, name, was)
    if isinstance(slim, PretrainedInterface):
        slim.config.output_hidden_states = True
        refused("config.output_hidden_states")
        slim.config.output_hidden_states = False
    slim.zero_grad(set_to_none=True)
    _loss(slim(**inputs)).backward()


def test_a_forward_hook_on_the_model_survives_deepcopies_as_on_the_model():
    """torch.fx's deep copy keeps only state_dict hooks: copies of the optimized module computed
    without the user's forward hook (``fxopt.core.modules.deepcopy_keeping_hooks``). A model
    with a graph per training mode (BatchNorm), copied twice, in both modes. torch.export refuses
    hooks on the model itself (``TraceError``), so this is the symbolic-tracing path."""
    model = nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4), nn.ReLU())
    model.register_forward_hook(lambda module, args, out: out * 2)
    x = torch.randn(3, 4)
    slim = fxopt.optimize(model, (x,), capture="fx")
    twice, reference = copy.deepcopy(copy.deepcopy(slim)), copy.deepcopy(model)
    for mode in (False, True):
        twice.train(mode)
        reference.train(mode)
        torch.testing.assert_close(twice(x), reference(x))
    assert _guards(twice) == 1


@pytest.mark.parametrize("grad", [False, True], ids=["no_grad", "grad"])
def test_an_error_mid_call_leaves_nothing_behind(pair, grad, monkeypatch):
    """An exception at an ATen call half-way through a forward (under ``"min"``, half-way
    through the first checkpointed region's body, boxed without grad): the module's state put
    back as a script would after catching it, the next forward and step compute what the model's
    do."""
    model, slim, inputs = _copies(pair)
    state = copy.deepcopy(slim.state_dict())
    counting = FailAt()
    inside: list[int] = []  # the ATen call numbers the first region's body made
    region_call = CheckpointedRegion.__call__

    def counted(region, *args):
        start = counting.calls
        try:
            return region_call(region, *args)
        finally:
            inside.extend([start, counting.calls] if not inside else [])

    def forward():
        torch.manual_seed(0)
        with torch.set_grad_enabled(grad):
            slim(**inputs)

    with monkeypatch.context() as patch:
        patch.setattr(CheckpointedRegion, "__call__", counted)
        with counting:
            forward()
    regions = any(isinstance(v, CheckpointedRegion) for m in slim.modules()
                  for v in vars(m).values())
    assert bool(inside) == regions
    at = (inside[0] + inside[1]) // 2 + 1 if regions else counting.calls // 2
    with pytest.raises(Injected) as caught, FailAt(at):
        forward()
    assert regions == any(str(entry.path).endswith("regions.py") for entry in caught.traceback)
    slim.load_state_dict(state)  # BatchNorm statistics the forwards moved: the script's own
    _assert_same_step(slim, model, inputs)


@pytest.mark.parametrize("assign", [False, True], ids=["copy", "assign"])
def test_load_state_dict(pair, assign):
    model, slim, inputs = _copies(pair)
    state = _new_state(model)
    model.load_state_dict(state, assign=assign)
    slim.load_state_dict({k: v.clone() for k, v in state.items()}, assign=assign)
    _assert_same_step(slim, model, inputs)


def test_replacing_a_parameter_object(pair):
    model, slim, inputs = _copies(pair)
    name, param = next(iter(model.named_parameters()))
    owner, _, attr = name.rpartition(".")
    value = torch.randn(param.shape, generator=torch.Generator().manual_seed(5))
    setattr(model.get_submodule(owner), attr, nn.Parameter(value.clone()))
    setattr(slim.get_submodule(owner), attr, nn.Parameter(value.clone()))
    _assert_same_step(slim, model, inputs)


def test_freezing_a_submodule(pair):
    model, slim, inputs = _copies(pair)
    frozen = [n for n, _ in model.named_children()][0]
    model.get_submodule(frozen).requires_grad_(False)
    slim.get_submodule(frozen).requires_grad_(False)
    _assert_same_step(slim, model, inputs)


def test_train_eval_switches(pair):
    model, slim, inputs = _copies(pair)
    for module in (model, slim):
        module.eval()
    with torch.no_grad():
        out, ref = slim(**inputs), model(**inputs)
    torch.testing.assert_close(_loss(out), _loss(ref), rtol=1e-5, atol=1e-6)
    for module in (model, slim):
        module.train()
    _assert_same_step(slim, model, inputs)


def test_state_dict_round_trip_through_torch_save(pair):
    model, slim, inputs = _copies(pair)
    state = _new_state(model)
    buffer = io.BytesIO()
    torch.save(state, buffer)
    buffer.seek(0)
    loaded = torch.load(buffer, weights_only=True)
    model.load_state_dict(state)
    slim.load_state_dict(loaded)
    buffer = io.BytesIO()
    torch.save(slim.state_dict(), buffer)
    buffer.seek(0)
    assert torch.load(buffer, weights_only=True).keys() == model.state_dict().keys()
    _assert_same_step(slim, model, inputs)


def test_the_module_and_a_deep_copy_of_it_pickle_alike(pair):
    """``torch.save`` of the optimized module, and of a deep copy of it (a best model kept with
    ``copy.deepcopy``), either loads as a module that computes the model's training step, or is
    refused by fxopt's ``ExportError``, the same way for both. A deep copy of a torch.export
    capture saved, and its torch.load raised torch.fx's NotImplementedError: GraphModule's copy
    takes its re-tracing class from the graph, which did not carry fxopt's."""
    model, slim, inputs = _copies(pair)
    outcomes = []
    for module in (slim, copy.deepcopy(slim)):
        buffer = io.BytesIO()
        try:
            torch.save(module, buffer)
        except fxopt.ExportError:
            outcomes.append("refused")
            continue
        buffer.seek(0)
        loaded = torch.load(buffer, weights_only=False)
        _assert_same_step(loaded, copy.deepcopy(model), inputs)
        outcomes.append("loaded")
    assert outcomes[0] == outcomes[1]


def test_functional_call_with_backward_after_it(pair):
    """``torch.func.functional_call(module, tensors, ...)`` swaps ``tensors`` in for the forward
    only; backward runs after it, as in a meta-learning step. A checkpointed region recomputes
    in backward, and read what its modules held then (the module's own parameters, as
    torch.utils.checkpoint does): the gradients of ``tensors`` were wrong on a "min" plan of a
    symbolic-traced CNN. It recomputes with what they held in the forward now."""
    model, slim, inputs = _copies(pair)
    generator = torch.Generator().manual_seed(5)
    swapped = {name: (p.detach() * 0.5 + 0.01 * torch.randn(p.shape, generator=generator))
               for name, p in model.named_parameters()}
    grads = []
    for module in (model, slim):
        leaves = {name: t.clone().requires_grad_() for name, t in swapped.items()}
        torch.manual_seed(0)
        loss = _loss(torch.func.functional_call(module, leaves, (), inputs))
        loss.backward()
        grads.append({name: t.grad for name, t in leaves.items()})
        assert all(p.grad is None for p in module.parameters())
    assert grads[0].keys() == grads[1].keys()
    for name, grad in grads[1].items():
        expected = grads[0][name]
        assert (grad is None) == (expected is None), name
        if grad is not None:
            scale = expected.abs().max().item()
            torch.testing.assert_close(grad, expected, rtol=1e-5, atol=1e-6 + 1e-5 * scale,
                                       msg=lambda m, name=name: f"grad of {name}: {m}")


@pytest.mark.parametrize("dtype", [torch.float64, torch.bfloat16, torch.float16],
                         ids=["float64", "bfloat16", "float16"])
def test_a_dtype_change(pair, dtype, request):
    """Symbolic-traced graphs are dtype-generic: the converted module computes what the
    converted model computes. An export-captured graph has its capture dtypes built in (the
    model's own casts, such as RMSNorm's ``.to(input_dtype)``, are recorded as casts to
    float32), so it refuses a converted module with an ``InputError`` at the call, before any
    compute: optimize the model after converting it."""
    model, slim, inputs = _copies(pair)
    model.to(dtype)
    slim.to(dtype)
    inputs = {k: v.to(dtype) if v.is_floating_point() else v for k, v in inputs.items()}
    if request.node.callspec.id.startswith("cnn-fx"):
        tolerance = {torch.float64: 1e-9, torch.bfloat16: 1e-2, torch.float16: 1e-3}[dtype]
        _assert_same_step(slim, model, inputs, rtol=tolerance, atol=tolerance)
        return
    calls = []
    hook = slim.register_forward_pre_hook(lambda *_: calls.append(1))
    with torch.autograd.graph.saved_tensors_hooks(lambda t: calls.append(t) or t, lambda t: t):
        with pytest.raises(InputError, match="optimize the model in its training dtype|"
                           "converted after capture"):
            slim(**inputs)
    hook.remove()
    assert len(calls) == 1  # the call began, and nothing was saved for backward: no compute


@pytest.mark.parametrize("shape", [(1, 32), (2, 17), (3, 77)], ids=["batch1", "seq17", "seq77"])
def test_other_batch_and_sequence_sizes(pair, shape, request):
    """A module optimized at one shape returns what the original returns at every shape the
    original accepts (the memory budget applies at the example shape)."""
    if request.node.callspec.id.startswith("cnn"):
        pytest.skip("sequence lengths are for the language models")
    model, slim, inputs = _copies(pair)
    ids = torch.randint(0, 256, shape, generator=torch.Generator().manual_seed(sum(shape)))
    resized = {"input_ids": ids,
               "labels": ids if inputs["labels"].dim() == 2 else torch.arange(shape[0]) % 3}
    _assert_same_step(slim, model, resized)
