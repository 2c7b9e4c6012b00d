"""fxopt.core.modules: structural_copy (new modules, the user's tensors, nothing shared to mutate)
and has_hooks (every hook that runs when a module is called, none that does not)."""

import pytest
import torch
import torch.nn.functional as F
from torch import fx, nn

from fxopt.capture.trace import trace
from fxopt.core.modules import (
    HOOK_DICTS,
    MODULE_CONTAINERS,
    call_hooks,
    copy_hooks,
    constant_values,
    has_hooks,
    modules_as_they_are,
    still_as_they_were,
    settable_constants,
    structural_copy,
)


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3, padding=1)
        self.bn = nn.BatchNorm2d(4)
        self.register_buffer("scale", torch.ones(1))
        self.register_buffer("scratch", torch.zeros(1), persistent=False)

    def forward(self, x):
        return F.relu(self.bn(self.conv(x))) * self.scale


class SharedPaths(nn.Module):
    """One module object at two paths (monai's DynUNet keeps its heads this way), and tied weights."""

    def __init__(self):
        super().__init__()
        self.block = Block()
        self.alias = self.block
        self.head = nn.Linear(4, 4)
        self.tail = nn.Linear(4, 4)
        self.tail.weight = self.head.weight

    def forward(self, x):
        h = self.block(x) + self.alias(x)
        return self.tail(self.head(h.mean((2, 3))))


def _hook_state(module: nn.Module) -> dict:
    return {name: dict(getattr(module, name)) for name in HOOK_DICTS}


def test_module_containers_cover_every_container_of_torch_2_14():
    assert set(MODULE_CONTAINERS) >= {
        "_parameters", "_buffers", "_non_persistent_buffers_set", "_modules",
        "_forward_pre_hooks", "_forward_pre_hooks_with_kwargs", "_forward_hooks",
        "_forward_hooks_with_kwargs", "_forward_hooks_always_called", "_backward_pre_hooks",
        "_backward_hooks", "_state_dict_hooks", "_state_dict_pre_hooks",
        "_load_state_dict_pre_hooks", "_load_state_dict_post_hooks"}
    assert len(HOOK_DICTS) >= 11


def test_copy_is_new_modules_of_the_same_class_over_the_same_tensors():
    model = SharedPaths()
    copy = structural_copy(model)
    originals, copies = dict(model.named_modules()), dict(copy.named_modules())
    assert list(originals) == list(copies)
    for path, module in originals.items():
        assert copies[path] is not module and type(copies[path]) is type(module)
    assert [id(p) for p in copy.parameters()] == [id(p) for p in model.parameters()]
    assert all(a is b for a, b in zip(copy.buffers(), model.buffers()))
    assert list(copy.state_dict()) == list(model.state_dict())
    assert copy.block._non_persistent_buffers_set == {"scratch"}


def test_shared_module_stays_shared_once_and_tied_weights_stay_tied():
    model = SharedPaths()
    copy = structural_copy(model)
    assert copy.alias is copy.block and copy.block is not model.block
    assert copy.tail.weight is copy.head.weight is model.head.weight
    assert len(list(copy.modules())) == len(list(model.modules()))


def test_lists_of_scalars_are_the_copys_own_and_other_values_shared():
    """A list of sizes or weights (what a forward may compute with, guarded by value) is the
    copy's own: the model appending to its own (a forward keeping a count) leaves the copy's as
    it was; a list of objects, a dict, a plain tensor stay shared, as documented."""
    model = nn.Linear(2, 2)
    model.sizes, model.nested, model.named = [1, 2], ([0.5], "x"), [nn.Identity()]
    model.table, model.mask = {"a": 1}, torch.ones(2)
    copy = structural_copy(model)
    assert (copy.sizes, copy.nested) == (model.sizes, model.nested)
    assert copy.sizes is not model.sizes and copy.nested[0] is not model.nested[0]
    assert copy.named is model.named and copy.table is model.table and copy.mask is model.mask
    model.sizes.append(3)
    assert copy.sizes == [1, 2]


def test_constant_values_of_a_list_are_what_it_holds_when_asked():
    """A record of ``constant_values`` taken once compares unequal to the module's values after
    its list changed in place, which no ``setattr`` shows; a list of objects is no constant."""
    class Spaced(nn.Module):
        def __init__(self):
            super().__init__()
            self.strides, self.modules_kept = [8, 16], [nn.Identity()]

    module = Spaced()
    record = modules_as_they_are(nn.Sequential(module), {"0"})
    assert dict(constant_values(module)) == {"strides": [8, 16]}
    module.strides[1] = 32
    assert dict(constant_values(module)) == {"strides": [8, 32]}
    assert not still_as_they_were(record)
    module.strides[1] = 16
    assert still_as_they_were(record)


def test_training_flags_are_copied_per_module():
    model = SharedPaths()
    model.block.bn.eval()
    copy = structural_copy(model)
    assert [m.training for m in copy.modules()] == [m.training for m in model.modules()]
    copy.eval()
    assert model.training and model.head.training


@pytest.mark.parametrize("register", [
    lambda m: m.register_forward_pre_hook(lambda mod, args: None),
    lambda m: m.register_forward_pre_hook(lambda mod, args, kwargs: None, with_kwargs=True),
    lambda m: m.register_forward_hook(lambda mod, args, out: None, always_call=True),
    lambda m: m.register_forward_hook(lambda mod, args, kwargs, out: None, with_kwargs=True),
    lambda m: m.register_full_backward_pre_hook(lambda mod, grad_out: None),
    lambda m: m.register_full_backward_hook(lambda mod, grad_in, grad_out: None),
    lambda m: m.register_state_dict_pre_hook(lambda mod, prefix, keep_vars: None),
    lambda m: m._register_state_dict_hook(lambda mod, sd, prefix, meta: None),
    lambda m: m.register_load_state_dict_pre_hook(lambda mod, *args: None),
    lambda m: m.register_load_state_dict_post_hook(lambda mod, keys: None),
], ids=["forward_pre", "forward_pre_kwargs", "forward_always", "forward_kwargs",
        "backward_pre", "backward", "state_dict_pre", "state_dict", "load_pre", "load_post"])
def test_hook_registered_on_the_copy_stays_on_the_copy(register):
    model = SharedPaths()
    before = {path: _hook_state(m) for path, m in model.named_modules()}
    copy = structural_copy(model)
    for module in copy.modules():
        register(module)
    assert {path: _hook_state(m) for path, m in model.named_modules()} == before


def test_submodules_parameters_and_buffers_changed_on_the_copy_stay_on_the_copy():
    model = SharedPaths()
    state = {k: v for k, v in model.state_dict(keep_vars=True).items()}
    copy = structural_copy(model)
    copy.extra = nn.Linear(1, 1)
    copy.block.bn = nn.Identity()
    copy.block.scale = torch.zeros(1)
    copy.block.register_buffer("scratch", torch.ones(2), persistent=True)
    copy.head.bias = nn.Parameter(torch.zeros(4))
    del copy.tail.bias
    assert model.state_dict(keep_vars=True).keys() == state.keys()
    assert all(v is state[k] for k, v in model.state_dict(keep_vars=True).items())
    assert isinstance(model.block.bn, nn.BatchNorm2d) and not hasattr(model, "extra")
    assert model.block._non_persistent_buffers_set == {"scratch"}


def test_hooks_on_the_original_fire_on_the_copy_and_its_handles_reach_only_the_original():
    model, calls = nn.Sequential(nn.Linear(2, 2)), []
    handle = model[0].register_forward_hook(
        lambda mod, args, kwargs, out: calls.append(mod), with_kwargs=True)
    model[0].register_full_backward_pre_hook(lambda mod, grad_out: calls.append("backward"))
    copy = structural_copy(model)
    copy(torch.randn(1, 2)).sum().backward()
    assert calls == [copy[0], "backward"]
    handle.remove()
    calls.clear()
    # Sharing _forward_hooks_with_kwargs (as fxopt once did) would now call the copied hook
    # without its kwargs argument: a TypeError.
    copy(torch.randn(1, 2))
    model(torch.randn(1, 2))
    assert calls == [copy[0]]


def test_copy_traces_to_the_same_graph_and_computes_the_same():
    torch.manual_seed(0)
    model, x = SharedPaths().eval(), torch.randn(2, 3, 5, 5)
    copy = structural_copy(model)
    assert fx.symbolic_trace(copy).code == fx.symbolic_trace(model).code
    assert torch.equal(copy(x), model(x))
    gm, gm_copy = trace(model, (x,)), trace(copy, (x,))
    assert gm.code == gm_copy.code and list(gm.state_dict()) == list(gm_copy.state_dict())


def test_graph_module_copy_has_its_own_graph_and_forward():
    gm = fx.symbolic_trace(nn.Sequential(nn.Linear(2, 2), nn.ReLU()))
    gm.meta["note"] = 1
    code, x = gm.code, torch.randn(3, 2)
    expected = gm(x)
    copy = structural_copy(gm)
    assert isinstance(copy, fx.GraphModule) and copy.graph is not gm.graph
    assert copy.get_submodule("0").weight is gm.get_submodule("0").weight
    assert torch.equal(copy(x), expected)
    for node in copy.graph.nodes:
        if node.op == "call_module" and node.target == "1":
            node.replace_all_uses_with(node.args[0])
            copy.graph.erase_node(node)
    copy.recompile()
    copy.meta["note"] = 2
    assert gm.code == code and torch.equal(gm(x), expected) and gm.meta["note"] == 1
    assert "relu" not in copy.code and gm.graph.owning_module is gm


def test_rnn_weight_replaced_on_the_copy_stays_on_the_copy():
    lstm = nn.LSTM(3, 4)
    copy = structural_copy(lstm)
    copy.weight_ih_l0 = nn.Parameter(torch.zeros_like(lstm.weight_ih_l0))
    assert lstm._flat_weights[0] is lstm.weight_ih_l0
    assert copy._flat_weights[0] is copy.weight_ih_l0


def test_parametrized_and_compiled_modules_are_copied():
    model = nn.Sequential(nn.utils.parametrizations.weight_norm(nn.Linear(3, 3)))
    model.compile()
    copy = structural_copy(model)
    assert "_compiled_call_impl" not in vars(copy)  # the copy runs eagerly
    x = torch.randn(2, 3)
    assert torch.equal(copy[0](x), model[0](x))
    assert list(copy.parameters()) == list(model.parameters())


# ---------------------------------------------------------------- has_hooks


@pytest.mark.parametrize("register, kind", [
    (lambda m: m.register_forward_pre_hook(lambda mod, args: None), "forward pre-hooks"),
    (lambda m: m.register_forward_pre_hook(lambda mod, a, k: None, with_kwargs=True),
     "forward pre-hooks"),
    (lambda m: m.register_forward_hook(lambda mod, args, out: None), "forward hooks"),
    (lambda m: m.register_forward_hook(lambda mod, a, o: None, always_call=True),
     "forward hooks"),
    (lambda m: m.register_full_backward_pre_hook(lambda mod, g: None), "backward pre-hooks"),
    (lambda m: m.register_full_backward_hook(lambda mod, gi, go: None), "backward hooks"),
    (lambda m: m.register_backward_hook(lambda mod, gi, go: None), "backward hooks"),
])
def test_has_hooks_sees_every_hook_that_runs_on_a_call(register, kind):
    module = nn.ReLU()
    assert not has_hooks(module)
    handle = register(module)
    assert has_hooks(module) and call_hooks(module) == [kind]
    handle.remove()
    assert not has_hooks(module)


def test_has_hooks_ignores_state_dict_hooks_submodules_and_process_wide_hooks():
    model = nn.Sequential(nn.ReLU())
    model.register_state_dict_pre_hook(lambda mod, prefix, keep_vars: None)
    model.register_load_state_dict_post_hook(lambda mod, keys: None)
    model[0].register_forward_hook(lambda mod, args, out: None)
    handle = torch.nn.modules.module.register_module_forward_hook(lambda mod, args, out: None)
    try:
        assert not has_hooks(model) and has_hooks(model[0])
    finally:
        handle.remove()


def test_copy_hooks_copies_every_hook_dict():
    source, target = nn.ReLU(), nn.ReLU()
    source.register_full_backward_hook(lambda mod, gi, go: None)
    source.register_forward_hook(lambda mod, a, k, o: None, with_kwargs=True)
    source.register_state_dict_pre_hook(lambda mod, prefix, keep_vars: None)
    copy_hooks(source, target)
    assert _hook_state(target) == _hook_state(source)
    assert target._is_full_backward_hook is True
    target.register_forward_pre_hook(lambda mod, args: None)
    assert not source._forward_pre_hooks


def test_set_instance_method_changes_one_graph_module_and_its_copies_only():
    """The one place fxopt patches a class: torch.fx gives each GraphModule a class of its own,
    so a special method set there reaches that module (and its deep copies) alone."""
    import copy

    from fxopt.core.modules import deepcopy_keeping_hooks, set_instance_method

    def refuse(self):
        raise RuntimeError("not this one")

    one = torch.fx.symbolic_trace(torch.nn.Linear(2, 2))
    other = torch.fx.symbolic_trace(torch.nn.Linear(2, 2))
    set_instance_method(one, "__deepcopy__", deepcopy_keeping_hooks)
    set_instance_method(one, "__reduce__", refuse)
    with pytest.raises(RuntimeError, match="not this one"):
        one.__reduce__()
    copy.deepcopy(other)  # untouched
    assert "__reduce__" in vars(type(copy.deepcopy(one)))  # carried to copies
    with pytest.raises(ValueError, match="copies would lose it"):
        set_instance_method(one, "__call__", refuse)
    with pytest.raises(RuntimeError, match="not a per-instance GraphModule class"):
        set_instance_method(torch.nn.Linear(2, 2), "__reduce__", refuse)


def test_settable_constants_are_the_torch_constants_a_script_sets_without_new_parameters():
    assert settable_constants(nn.BatchNorm2d) == ("track_running_stats", "momentum", "eps")
    assert settable_constants(nn.Dropout) == ("p",)
    assert settable_constants(nn.LeakyReLU) == ("negative_slope",)
    assert settable_constants(nn.Conv2d) == () and settable_constants(nn.Linear) == ()

    class Custom(nn.Dropout):  # a class of the user's own: its attributes are not known
        pass

    assert settable_constants(Custom) == ()


def test_constant_values_are_torch_constants_or_the_scalars_a_users_module_holds():
    """A ``torch.nn`` module: its settable constants. A module of another class: every public
    scalar attribute of the instance (a subclass of a torch module is one: Custom's ``p`` and
    ``inplace``), none of its containers, private attributes or submodules."""
    assert constant_values(nn.Dropout(0.3)) == (("p", 0.3),)
    assert constant_values(nn.Linear(2, 2)) == ()

    class Custom(nn.Dropout):
        pass

    class Scaled(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(2, 2)
            self.scale, self.causal, self.window = 0.5, True, (4, 4)
            self.dtype_, self.note = torch.bfloat16, None
            self.table, self.pairs, self._private = {"a": 1}, ((1, 2),), 3

    assert constant_values(Custom(0.2)) == (("p", 0.2), ("inplace", False))
    assert constant_values(Scaled()) == (("scale", 0.5), ("causal", True), ("window", (4, 4)),
                                         ("dtype_", torch.bfloat16), ("note", None),
                                         ("pairs", ((1, 2),)))


class Flagged(nn.Identity):
    def __init__(self):
        super().__init__()
        self.on = True


def test_the_record_of_modules_sees_a_class_a_mode_a_constant_or_a_hook_change():
    """``modules_as_they_are`` / ``still_as_they_were``, what the call guard compares on every
    call: each change to a recorded module, or to a module above one, is seen; a change to a
    module it does not record, or to the root itself, is not asked about."""
    model = nn.Sequential(nn.Linear(2, 2), nn.Dropout(0.1),
                          nn.Sequential(nn.BatchNorm1d(2), nn.ReLU()))
    paths = {"0", "1", "2.0"}
    record = modules_as_they_are(model, paths)
    assert [entry[1] for entry in record] == ["0", "1", "2", "0"]  # parents first
    assert still_as_they_were(record)
    changes = [lambda: setattr(model[1], "p", 0.2), lambda: model[2][0].eval(),
               lambda: model.__setitem__(0, nn.Identity()),
               lambda: model.__setitem__(0, Flagged()), lambda: setattr(model[0], "on", False),
               lambda: model[2].register_forward_pre_hook(lambda *a: None),
               lambda: model.__setitem__(2, nn.Sequential(nn.BatchNorm1d(2), nn.ReLU()))]
    for change in changes:
        change()
        assert not still_as_they_were(record)
        record = modules_as_they_are(model, paths)
        assert still_as_they_were(record)
    model.register_forward_hook(lambda *a: None)  # the root's own: not asked about
    model[2][1].register_forward_hook(lambda *a: None)  # not recorded
    model[2][1].eval()
    assert still_as_they_were(record)
