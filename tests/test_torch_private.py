"""fxopt's dependence on private torch APIs, listed and checked in one place.

``fxopt/core/torch_private.py`` is the only module that reaches into torch's private modules and
attributes (nn.Module's own containers excepted: ``fxopt/core/modules.py``). The first tests
check that everything it relies on still exists and behaves as assumed in the installed torch:
a torch upgrade that breaks one of them fails here, by name. The last one scans fxopt for private
torch use anywhere else.
"""

import ast
import inspect
import logging
import re
import threading
from pathlib import Path

import pytest
import torch
from torch import fx, nn

from fxopt.core import torch_private as private
from fxopt.core.modules import CALL_HOOK_DICTS, HOOK_DICTS
from fxopt.runtime.regions import PRIVATE_HEAVY_OPS, PRIVATE_LIGHT_OPS, TENSOR_CONTAINERS

ROOT = Path(__file__).resolve().parents[1]


def test_reparametrize_module_swaps_and_restores_with_tied_weights():
    assert "tie_weights" in inspect.signature(private._reparametrize_module).parameters
    model = nn.Linear(2, 2)
    weight = model.weight
    with private.reparametrize_module(model, {"weight": torch.zeros(2, 2)}):
        assert torch.equal(model.weight, torch.zeros(2, 2))
    assert model.weight is weight


def test_graph_code_generators():
    graph = fx.symbolic_trace(nn.ReLU()).graph
    assert private.has_plain_codegen(graph)
    other = fx.Graph()
    private.copy_codegen(graph, other)
    assert private.codegen_of(other) is private.codegen_of(graph)


def test_a_class_over_a_graph_modules_own_keeps_working_after_recompile():
    gm = fx.symbolic_trace(nn.Sequential(nn.Linear(3, 3), nn.ReLU()))
    assert {"_wrapped_call", "__call__"} <= set(vars(type(gm)))  # what recompile() installs
    bare = private.without_call_wrapper(type(gm))
    assert not {"_wrapped_call", "__call__"} & set(vars(bare)) and "forward" in vars(bare)
    x = torch.randn(2, 3)
    expected = gm(x)
    gm.__class__ = type("GraphModuleImpl", (bare,), {})
    gm.recompile()
    assert torch.equal(gm(x), expected)


def test_storage_id_is_shared_by_views_and_differs_between_storages():
    x = torch.randn(4, 4)
    assert private.storage_id(x.untyped_storage()) == private.storage_id(x[1:].untyped_storage())
    assert private.storage_id(x.untyped_storage()) != private.storage_id(
        x.clone().untyped_storage())


def test_rnn_weight_cache_and_mkldnn_workspace():
    lstm = nn.LSTM(3, 4)
    assert private.keeps_rnn_weight_cache(lstm) and not private.keeps_rnn_weight_cache(nn.ReLU())
    assert private.RNN_WEIGHT_CACHES <= set(vars(lstm))
    assert private.rebuild_rnn_weights(lstm) and not private.rebuild_rnn_weights(nn.ReLU())
    returns = torch.ops.aten.mkldnn_rnn_layer.default._schema.returns
    assert len(returns) > private.MKLDNN_RNN_WORKSPACE_INDEX


def test_fake_tensors_and_dispatch_modes():
    with private.FakeTensorMode() as mode:
        fake = mode.from_tensor(torch.randn(2, 3))
        assert isinstance(fake, private.FakeTensor)
        with private.disable_current_modes():
            assert not isinstance(torch.ones(1), private.FakeTensor)
    assert issubclass(private.TorchDispatchMode, object)
    meta = private.tensor_metadata(torch.randn(2, 3))
    assert tuple(meta.shape) == (2, 3) and meta.dtype == torch.float32


def test_quiet_fake_tensor_logs_is_scoped():
    logger = logging.getLogger(private._FAKE_TENSOR_LOGGER)
    level = logger.level
    with private.quiet_fake_tensor_logs():
        assert logger.level == logging.CRITICAL
    assert logger.level == level


def test_module_base_classes_and_compile_knobs():
    assert isinstance(nn.BatchNorm2d(3), private.BatchNormBase)
    assert isinstance(nn.Dropout2d(), private.DropoutBase)
    assert callable(private.compile_backend("aot_eager_decomp_partition"))
    with private.min_cut_memory_budget(0.25):
        from torch._functorch import config
        assert config.activation_memory_budget == 0.25
    from torch._dynamo import config as dynamo_config
    with private.recompiles_unlimited():
        assert dynamo_config.recompile_limit >= 2**16
        assert dynamo_config.accumulated_recompile_limit >= 2**16
    assert dynamo_config.recompile_limit == 8


# Private torch names fxopt code may only touch through fxopt.core.torch_private.
PRIVATE_ATTRIBUTES = {"_codegen", "_cdata", "_flat_weights", "_flat_weight_refs",
                      "_init_flat_weights", "_dynamo", "_functorch", "_subclasses", "_pytree",
                      "_python_dispatch"}
# nn.Module's own per-instance containers: core/modules.py reads them.
MODULE_CONTAINERS = {"_parameters", "_buffers", "_modules", "_non_persistent_buffers_set",
                     *HOOK_DICTS}
# Private names the runtime spells, by module: it cannot import fxopt.core.torch_private (export
# copies it where fxopt is not installed), so it looks them up by name itself;
# test_private_aten_ops_the_runtime_keeps_exist, test_the_hook_dicts_the_runtime_names_exist and
# test_the_tensor_containers_the_runtime_names_hold_what_functional_call_swaps check them.
RUNTIME_PRIVATE = {"fxopt/runtime/regions.py": {*PRIVATE_HEAVY_OPS, *PRIVATE_LIGHT_OPS,
                                                *TENSOR_CONTAINERS},
                   "fxopt/runtime/module_hooks.py": set(CALL_HOOK_DICTS)}
_DOTTED_PRIVATE = re.compile(r"\btorch(?:\.\w+)*\._[A-Za-z]\w*")
_ATTRIBUTE_IN_CODE = re.compile(r"\.(_[A-Za-z]\w*)")


def _private(names) -> set[str]:
    return {n for n in names if n.startswith("_") and not n.startswith("__")}


def torch_private_names() -> set[str]:
    """Private attribute names of the torch objects fxopt works with: modules (an RNN, a
    GraphModule), tensors, storages, graphs and nodes, torch.utils.checkpoint and the ATen
    operators. A string spelling one is a private use as much as an attribute access is."""
    objects = [nn.Module(), fx.GraphModule(nn.Module(), fx.Graph()), nn.LSTM(1, 1),
               torch.zeros(1), torch.zeros(1).untyped_storage(), fx.Graph(), fx.Node,
               torch.utils.checkpoint, torch.utils.checkpoint.CheckpointFunction, torch.ops.aten]
    names = set()
    for obj in objects:
        names |= _private(dir(obj))
        names |= _private(getattr(obj, "__dict__", {}))
    return names


TORCH_PRIVATE_NAMES = torch_private_names()


def _docstrings(tree: ast.AST) -> set[int]:
    return {id(node.body[0].value) for node in ast.walk(tree)
            if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef))
            and node.body and isinstance(node.body[0], ast.Expr)
            and isinstance(node.body[0].value, ast.Constant)}


def _string_uses(node: ast.Constant, banned: set[str]) -> list[str]:
    """A string naming a private torch attribute, a private torch module path, or (in code that
    fxopt writes, such as export's template) accessing a private torch attribute."""
    text, found = node.value, []
    if text in banned:
        found.append(f"line {node.lineno}: {text!r}")
    found += [f"line {node.lineno}: {m!r} in a string" for m in _DOTTED_PRIVATE.findall(text)]
    if text not in banned:
        rest = _DOTTED_PRIVATE.sub("", text)
        found += [f"line {node.lineno}: '.{m}' in a string"
                  for m in _ATTRIBUTE_IN_CODE.findall(rest) if m in banned]
    return found


def private_uses(source: str, *, containers_allowed: bool, allowed: frozenset = frozenset()
                 ) -> list[str]:
    found = []
    tree = ast.parse(source)
    docstrings = _docstrings(tree)
    banned = ((PRIVATE_ATTRIBUTES | TORCH_PRIVATE_NAMES)
              - (MODULE_CONTAINERS if containers_allowed else set()) - set(allowed))
    for node in ast.walk(tree):
        if isinstance(node, ast.Constant) and isinstance(node.value, str):
            if id(node) not in docstrings:
                found += _string_uses(node, banned)
            continue
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("torch"):
            parts = node.module.split(".")
            if any(p.startswith("_") for p in parts) or any(
                    a.name.startswith("_") for a in node.names):
                found.append(f"line {node.lineno}: from {node.module} import ...")
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.startswith("torch") and any(
                        p.startswith("_") for p in alias.name.split(".")):
                    found.append(f"line {node.lineno}: import {alias.name}")
        elif isinstance(node, ast.Attribute):
            own = isinstance(node.value, ast.Name) and node.value.id in ("self", "cls")
            # every private name of the torch objects fxopt works with, as strings are checked
            # (a 10-name list missed aten._to_copy, torch._ops, tensor._version: review 3.2)
            if node.attr in banned and not own:
                found.append(f"line {node.lineno}: .{node.attr}")
            elif node.attr.startswith("_") and _private_torch_chain(node):
                found.append(f"line {node.lineno}: {_private_torch_chain(node)}")
    return found


def _private_torch_chain(node: ast.Attribute) -> str | None:
    """``torch.a._b`` written out: an attribute chain from the name ``torch`` through a private
    part, whatever that part is called."""
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if not (isinstance(node, ast.Name) and node.id == "torch"):
        return None
    parts.reverse()
    if any(p.startswith("_") and not p.startswith("__") for p in parts):
        return "torch." + ".".join(parts)
    return None


def test_no_private_torch_use_outside_torch_private():
    allowed = {ROOT / "fxopt/core/torch_private.py"}
    offenders = {}
    for path in [*ROOT.glob("fxopt/**/*.py"), *ROOT.glob("passes/*.py")]:
        if path in allowed:
            continue
        relative = str(path.relative_to(ROOT))
        uses = private_uses(path.read_text(),
                            containers_allowed=path == ROOT / "fxopt/core/modules.py",
                            allowed=frozenset(RUNTIME_PRIVATE.get(relative, ())))
        if uses:
            offenders[str(path.relative_to(ROOT))] = uses
    assert offenders == {}


def test_the_scan_sees_each_kind_of_private_use():
    planted = ("from torch._subclasses.fake_tensor import FakeTensorMode\n"
               "import torch.utils._pytree as pytree\n"
               "from torch.nn.utils.stateless import _reparametrize_module\n"
               "gm.graph._codegen\n"
               "module._parameters\n"
               "self._parameters\n")
    assert len(private_uses(planted, containers_allowed=False)) == 5
    assert len(private_uses(planted, containers_allowed=True)) == 4
    strings = ('"""A docstring may name torch._C and module._parameters."""\n'
               'getattr(module, "_parameters")\n'
               'mock.patch.object(checkpoint, "_checkpoint_without_reentrant_generator_impl")\n'
               'HEADER = "import torch.fx._pytree as fx_pytree"\n'
               'line = f"{var}._init_flat_weights()"\n'
               'HEAVY = ("mm", "_scaled_mm")\n'
               'getattr(self, "_fxopt_region_0")\n')
    def lines(found):
        return sorted(found, key=lambda f: int(f.split(":")[0].split()[1]))

    found = lines(private_uses(strings, containers_allowed=False))
    assert [f.split(":")[0] for f in found] == ["line 2", "line 3", "line 4", "line 5", "line 6"]
    assert lines(private_uses(strings, containers_allowed=True, allowed=frozenset(
        {"_checkpoint_without_reentrant_generator_impl"}))) == [
        "line 4: 'torch.fx._pytree' in a string", "line 5: '._init_flat_weights' in a string",
        "line 6: '_scaled_mm'"]
    # attribute uses that a fixed list of names missed (review 3.2): a private ATen op, a
    # private torch module in an attribute chain, a tensor's private counter
    attributes = ("aten._to_copy.default\n"
                  "isinstance(fn, torch._ops.OpOverload)\n"
                  "t._version\n"
                  "self._fxopt_region_0\n")
    assert [f.split(":")[0] for f in lines(private_uses(attributes, containers_allowed=False))
            ] == ["line 1", "line 2", "line 3"]


def test_private_aten_ops_the_runtime_keeps_exist():
    """The runtime names these itself (it cannot import the facade): each must still exist."""
    assert all(hasattr(torch.ops.aten, name) for name in (*PRIVATE_HEAVY_OPS, *PRIVATE_LIGHT_OPS))


def test_the_tensor_containers_the_runtime_names_hold_what_functional_call_swaps():
    """A region recomputes with what its modules held in the forward, read from these dicts
    (``fxopt.runtime.regions.TENSOR_CONTAINERS``): every module has them, they hold its
    parameters and buffers by name, and ``torch.func.functional_call`` swaps its tensors in
    there for the call."""
    module = nn.BatchNorm1d(2)
    assert set(TENSOR_CONTAINERS) <= set(MODULE_CONTAINERS)
    parameters, buffers = (vars(module)[name] for name in TENSOR_CONTAINERS)
    assert parameters == dict(module.named_parameters(recurse=False))
    assert buffers == dict(module.named_buffers(recurse=False))
    swapped = {"weight": torch.ones(2), "running_mean": torch.ones(2)}
    seen = {}
    module.register_forward_pre_hook(lambda m, args: seen.update(
        weight=parameters["weight"], running_mean=buffers["running_mean"]))
    torch.func.functional_call(module, swapped, (torch.randn(3, 2),))
    assert all(seen[name] is tensor for name, tensor in swapped.items())
    assert parameters["weight"] is module.weight and module.weight is not swapped["weight"]


def test_the_hook_dicts_the_runtime_names_exist():
    """The call guards find hooks by these names (``fxopt.runtime.module_hooks``): each is a
    container every nn.Module has, and a hook registered each public way lands in one."""
    assert set(CALL_HOOK_DICTS) <= set(HOOK_DICTS)
    ways = [lambda m: m.register_forward_pre_hook(lambda *a: None),
            lambda m: m.register_forward_pre_hook(lambda *a, **k: None, with_kwargs=True),
            lambda m: m.register_forward_hook(lambda *a: None),
            lambda m: m.register_forward_hook(lambda *a: None, always_call=True),
            lambda m: m.register_full_backward_pre_hook(lambda *a: None),
            lambda m: m.register_full_backward_hook(lambda *a: None)]
    for register in ways:
        module = nn.Linear(1, 1)
        register(module)
        assert any(vars(module)[name] for name in CALL_HOOK_DICTS)


def test_written_arguments_reads_the_schema():
    assert private.written_arguments(torch.ops.aten.relu_.default) == ((0, "self"),)
    assert private.written_arguments(torch.ops.aten.copy_.default) == ((0, "self"),)
    assert private.written_arguments(torch.ops.aten.relu.default) == ()
    assert private.written_arguments(torch.relu) is None


def test_export_guards_and_size_oblivious_export():
    from torch.export import Dim
    from torch.fx.experimental import _config as shapes_config

    class Branch(nn.Module):
        def forward(self, x):
            return x * 2 if x.shape[0] > 1 else x

    assert not shapes_config.backed_size_oblivious
    with private.size_oblivious_export():
        assert shapes_config.backed_size_oblivious
        program = torch.export.export(Branch(), (torch.randn(1, 3),),
                                      dynamic_shapes=({0: Dim.AUTO},), strict=False)
    assert not shapes_config.backed_size_oblivious
    # traced at a size of 1, kept symbolic: the branch taken there is a recorded condition
    guards = private.export_guards(program)
    assert any("L['x'].size()[0]" in g for g in guards), guards


def test_checkpoint_calls_are_refused_in_the_tracing_thread_only():
    """While one thread captures (refusing checkpoint calls), another thread's checkpoint runs;
    both entry points are torch's own again when the last scope closes."""
    import torch.utils.checkpoint as cp

    entry, _reentrant = private.checkpoint_entries()
    before = (getattr(cp, entry), "apply" in vars(cp.CheckpointFunction))

    class Refused(Exception):
        pass

    def refuse():
        raise Refused

    def run(reentrant):
        x = torch.randn(3, requires_grad=True)
        cp.checkpoint(torch.sin, x, use_reentrant=reentrant).sum().backward()
        return x.grad

    inside, done, results = threading.Event(), threading.Event(), {}

    def tracing_thread():
        with private.checkpoint_calls_refused(refuse):
            inside.set()
            for reentrant in (False, True):
                try:
                    run(reentrant)
                except Refused:
                    results[f"refused {reentrant}"] = True
            done.wait(timeout=30)

    tracer = threading.Thread(target=tracing_thread)
    tracer.start()
    assert inside.wait(timeout=30)
    try:
        for reentrant in (False, True):  # this thread, meanwhile: checkpoints as usual
            assert run(reentrant) is not None
    finally:
        done.set()
        tracer.join(timeout=30)
    assert results == {"refused False": True, "refused True": True}
    assert (getattr(cp, entry), "apply" in vars(cp.CheckpointFunction)) == before


def test_the_gated_entry_is_the_one_this_torchs_checkpoint_calls(monkeypatch):
    """torch 2.11's checkpoint() calls ``_checkpoint_without_reentrant_generator``, 2.14's
    ``..._generator_impl``: the gate finds the name in checkpoint()'s own code, so a release
    that renames it is gated too (a fixed name left 2.11 ungated, silently)."""
    import torch.utils.checkpoint as cp

    assert private.checkpoint_entries() == ("_checkpoint_without_reentrant_generator_impl",
                                            "CheckpointFunction.apply")  # torch 2.14

    def renamed_generator(fn, *args, **kwargs):
        raise AssertionError("not reached: the gate refuses first")
    renamed_generator.__module__ = cp.__name__  # as if torch.utils.checkpoint defined it

    def checkpoint_of_another_release(function, *args, use_reentrant=None, **kwargs):
        gen = _checkpoint_without_reentrant_generator(function)  # noqa: F821 (module global)
        return gen

    monkeypatch.setattr(cp, "_checkpoint_without_reentrant_generator", renamed_generator,
                        raising=False)
    monkeypatch.setattr(cp, "checkpoint", checkpoint_of_another_release)
    assert private.checkpoint_entries() == ("_checkpoint_without_reentrant_generator",
                                            "CheckpointFunction.apply")

    class Refused(Exception):
        pass

    def refuse():
        raise Refused

    with private.checkpoint_calls_refused(refuse):
        with pytest.raises(Refused):
            cp._checkpoint_without_reentrant_generator(torch.sin)


def test_graph_module_attributes_leave_out_only_the_graph_and_what_fx_derives_from_it():
    """The prediction memo describes a GraphModule by its code and these attributes: a torch
    that stores the graph under another name would make every fingerprint walk the graph."""
    from fxopt.core.torch_private import graph_module_attributes, graph_module_class_members
    gm = fx.symbolic_trace(nn.Sequential(nn.Linear(2, 2)))
    kept = graph_module_attributes(gm)
    assert not any(isinstance(v, (fx.Graph, str)) for v in kept.values())
    assert set(vars(gm)) - set(kept) <= {"graph", "_graph", "_code", "_lineno_map",
                                         "_prologue_start", "_tracer_cls", "_tracer_extras"}
    assert {"_modules", "_parameters", "_buffers", "_forward_hooks", "training"} <= set(kept)
    assert graph_module_class_members(type(gm)) == {}  # fx's forward and call wrapper only
