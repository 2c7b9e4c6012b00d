"""fxopt.export: the folder loads with plain torch (no fxopt), computes what the model computes,
and keeps the original's state_dict; bad cases fail with ExportError."""

import copy
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from torch import nn

import fxopt
import fxopt.export.codegen
from fxopt import models_zoo
from fxopt.capture.trace import trace
from fxopt.cli.targets import load_target
from fxopt.export.writer import ExportBug, ExportError, export, load_exported
from fxopt.measure.peaks import measure_inference

TINY_NET = '''
import torch
from torch import nn


class Gate(nn.Module):
    """Data-dependent control flow: torch.fx cannot trace it, fxopt keeps it as a leaf."""

    def __init__(self, width):
        super().__init__()
        self.scale = nn.Parameter(torch.ones(width))
        self.threshold = 0.0

    def forward(self, x):
        if x.sum() > self.threshold:
            return x * self.scale
        return x - self.scale


class TinyNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(6, 8)
        self.gate = Gate(8)
        self.fc2 = nn.Linear(8, 3)

    def forward(self, x):
        return self.fc2(torch.relu(self.gate(self.fc1(x))))
'''


def conv_stack(width: int = 8, depth: int = 3) -> nn.Module:
    """Activation-heavy with BatchNorm and dropout, so a budget gives checkpointed regions."""
    layers: list[nn.Module] = [nn.Conv2d(3, width, 3, padding=1)]
    for _ in range(depth):
        layers += [nn.BatchNorm2d(width), nn.ReLU(), nn.Dropout(0.1),
                   nn.Conv2d(width, width, 3, padding=1)]
    return nn.Sequential(*layers, nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(width, 5))


def _expected_step(model: nn.Module, x: torch.Tensor) -> dict:
    """What a fresh process must reproduce: eval output, and one seeded train step's output and
    gradients (dropout masks included)."""
    clone = copy.deepcopy(model)  # the user's model object is never touched
    clone.eval()
    with torch.no_grad():
        eval_out = clone(x)
    clone.train()
    torch.manual_seed(0)
    xin = x.clone().requires_grad_(True)
    out = clone(xin)
    out.backward(torch.ones_like(out))
    grads = {name: p.grad for name, p in clone.named_parameters()}
    return {"eval": eval_out, "train": out.detach(), "input_grad": xin.grad, **{
        f"grad.{k}": v for k, v in grads.items()}}


@pytest.fixture(scope="module")
def exports(tmp_path_factory):
    """Four exports: a plain rewrite, checkpointed regions under a budget, an opaque leaf, and a
    module torch.export captured (its input guard raises the runtime's copied InputError)."""
    root = tmp_path_factory.mktemp("exports")
    (root / "usercode").mkdir()
    (root / "usercode" / "tinynet.py").write_text(TINY_NET)
    cases = {}
    model, inputs = models_zoo.build("mnist_net", 2)
    cases["plain"] = (model, inputs[0], fxopt.optimize(model, inputs, verify=False))
    torch.manual_seed(0)
    model, x = conv_stack(), torch.randn(2, 3, 16, 16)
    cases["budget"] = (model, x, fxopt.optimize(model, x, memory_budget=0.7, verify=False))
    model, inputs = load_target(f"{root / 'usercode' / 'tinynet.py'}:TinyNet", input_shape=(4, 6))
    cases["leaf"] = (model, inputs[0], fxopt.optimize(model, inputs, verify=False))
    torch.manual_seed(0)
    model, x = nn.Sequential(nn.Linear(6, 8), nn.ReLU(), nn.Linear(8, 3)), torch.randn(4, 6)
    cases["guarded"] = (model, x, fxopt.optimize(model, x, capture="export", verify=False))
    results = {}
    for name, (model, x, gm) in cases.items():
        results[name] = export(gm, root / name, example_inputs=(x,))
        torch.save(_expected_step(model, x), root / f"{name}_expected.pt")
        torch.save(x, root / f"{name}_input.pt")
    return root, cases, results


def test_each_export_is_reloaded_and_verified(exports):
    _, cases, results = exports
    for name, result in results.items():
        assert result.verification is not None and result.verification.ok, name
        assert result.verification.checked["param_grad"] > 0
    assert results["budget"].regions >= 1
    assert "_runtime_fxopt_runtime_regions.py" in results["budget"].files
    assert results["plain"].regions == 0 and results["plain"].needs == []
    assert results["leaf"].needs == ["tinynet"]


def test_state_dict_keys_and_weights_load_with_weights_only(exports):
    root, cases, results = exports
    for name, (model, _, _) in cases.items():
        weights = torch.load(root / name / "state_dict.pt", weights_only=True)
        assert list(weights) == list(model.state_dict())
        exported = load_exported(root / name).load()
        assert list(exported.state_dict()) == list(model.state_dict())
        assert all(tuple(exported.state_dict()[k].shape) == tuple(v.shape)
                   for k, v in model.state_dict().items())
        fresh = load_exported(root / name).__dict__[results[name].class_name]()
        fresh.load_state_dict(model.state_dict())  # a checkpoint of the original loads (strict)


def test_region_model_uses_the_copied_runtime(exports):
    root, _, _ = exports
    exported = load_exported(root / "budget").load()
    regions = [v for k, v in vars(exported).items() if k.startswith("_fxopt_region_")]
    assert regions and all(type(r).__module__.endswith("_runtime_fxopt_runtime_regions") for r in regions)
    assert type(regions[0]).__module__ != "fxopt.runtime.regions"


def test_exported_regions_free_their_inputs_without_grad(tmp_path):
    """An exported region body carries its boxed code (``boxed_forward``), so the exported
    module's inference peak is the unoptimized one's: each region input freed at its last use in
    the body. Without that code the body holds its inputs until it returns (one 4x12x32x32 map
    more here, the regions starting after the first convolution)."""
    torch.manual_seed(0)
    model, x = conv_stack(width=12, depth=6), torch.randn(4, 3, 32, 32)
    optimized = fxopt.optimize(model, x, passes=[("checkpoint", {"budget": 0.5, "profile": False})],
                               verify=False)
    export(optimized, tmp_path / "out", example_inputs=(x,))
    exported = load_exported(tmp_path / "out").load()
    regions = [v for k, v in vars(exported).items() if k.startswith("_fxopt_region_")]
    assert regions and all(r.boxed and hasattr(type(r.body), "boxed_forward") for r in regions)
    unoptimized = measure_inference(trace(model, x), x).peak_bytes
    assert measure_inference(exported, x).peak_bytes == unoptimized
    for region in regions:
        del type(region.body).boxed_forward
    assert measure_inference(exported, x).peak_bytes > unoptimized


def test_loads_in_a_fresh_process_without_fxopt(exports):
    """-S -I: no site (so no editable fxopt finder), no PYTHONPATH, no user site; only torch's
    site-packages and the user's own code directory are added, and fxopt must be unimportable."""
    root, _, _ = exports
    site_packages = Path(torch.__file__).resolve().parent.parent
    script = textwrap.dedent(f"""
        import importlib.util, sys
        sys.path[:] = [p for p in sys.path if p not in ('', '.')]
        sys.path += [{str(site_packages)!r}, {str(root)!r}, {str(root / 'usercode')!r}]
        for name in ('fxopt', 'passes', 'models_zoo'):
            assert importlib.util.find_spec(name) is None, name
        import torch
        for name in ('plain', 'budget', 'leaf', 'guarded'):
            package = __import__(name)
            x = torch.load({str(root)!r} + f'/{{name}}_input.pt', weights_only=True)
            expected = torch.load({str(root)!r} + f'/{{name}}_expected.pt', weights_only=True)
            model = package.load()
            model.eval()
            with torch.no_grad():
                torch.testing.assert_close(model(x), expected['eval'])
            model.train()
            torch.manual_seed(0)
            xin = x.clone().requires_grad_(True)
            out = model(xin)
            out.backward(torch.ones_like(out))
            torch.testing.assert_close(out.detach(), expected['train'])
            torch.testing.assert_close(xin.grad, expected['input_grad'])
            for key, param in model.named_parameters():
                torch.testing.assert_close(param.grad, expected['grad.' + key])
        try:  # the guard's copy raises the copied runtime's InputError
            __import__('guarded').load()(x.double())
        except Exception as error:
            assert type(error).__name__ == 'InputError', error
            assert 'captured by torch.export' in str(error), error
        else:
            raise AssertionError('the guard let a float64 input through')
        assert not any(m.split('.')[0] in ('fxopt', 'passes', 'models_zoo') for m in sys.modules)
        print('ok')
    """)
    done = subprocess.run([sys.executable, "-S", "-I", "-c", script], cwd=root,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.strip() == "ok"


def test_export_that_would_compute_something_else_is_refused(exports, tmp_path, monkeypatch):
    _, cases, _ = exports
    _, x, gm = cases["plain"]
    real_generate = fxopt.export.codegen.generate

    def planted_bug(*args, **kwargs):  # a dropout probability written wrong
        generated = real_generate(*args, **kwargs)
        assert "'p': 0.25" in generated.source
        generated.source = generated.source.replace("'p': 0.25", "'p': 0.3")
        return generated

    monkeypatch.setattr("fxopt.export.writer.generate", planted_bug)
    with pytest.raises(ExportBug, match="computes something else") as info:
        export(gm, tmp_path / "bad", example_inputs=x)
    assert "bug in fxopt's export" in info.value.hint and "bisect" not in str(info.value)
    assert "output" in {m.kind for m in info.value.report.mismatches}
    assert list(tmp_path.iterdir()) == []  # nothing written is left, not even the staging folder


def test_export_is_all_or_nothing_into_an_existing_folder(exports, tmp_path, monkeypatch):
    """A failed export leaves the user's folder as it was; a successful one replaces the files
    of the previous export there (constants.pt is gone when the new one has none) and keeps the
    user's own."""
    _, cases, _ = exports
    _, x, gm = cases["plain"]
    out = tmp_path / "out"
    out.mkdir()
    (out / "notes.txt").write_text("mine")
    (out / "constants.pt").write_bytes(b"old")
    (out / "manifest.json").write_text('{"files": ["model.py", "constants.pt", "manifest.json"]}')
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    with monkeypatch.context() as patch:
        patch.setattr("fxopt.export.writer._write", lambda *a: 1 / 0)  # a crash while writing
        with pytest.raises(ExportBug, match="writing the files failed: ZeroDivisionError"):
            export(gm, out, example_inputs=x)
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]
    result = export(gm, out, example_inputs=x)
    assert sorted(p.name for p in out.iterdir()) == sorted([*result.files, "notes.txt"])
    assert "constants.pt" not in result.files and (out / "notes.txt").read_text() == "mine"
    assert load_exported(out).load() is not None
    (tmp_path / "file").write_text("")
    with pytest.raises(ExportError, match="a file, not a folder"):
        export(gm, tmp_path / "file")


def test_leaf_class_that_cannot_be_imported_is_a_clear_error(tmp_path):
    class LocalGate(nn.Module):  # defined in a function: no import path
        def forward(self, x):
            return x * 2 if x.sum() > 0 else x

    model = nn.Sequential(nn.Linear(4, 4), LocalGate())
    gm = fxopt.optimize(model, torch.randn(2, 4), verify=False)
    with pytest.raises(ExportError, match="cannot be imported by name") as info:
        export(gm, tmp_path / "local")
    assert "module level" in info.value.hint


def test_tied_weights_and_frozen_parameters_survive(tmp_path):
    model = nn.Sequential(nn.Embedding(10, 4), nn.Linear(4, 10, bias=False))
    model[1].weight = model[0].weight
    model[0].weight.requires_grad_(False)
    x = torch.randint(0, 10, (3, 5))
    gm = fxopt.optimize(model, x, verify=False)
    export(gm, tmp_path / "tied", example_inputs=x)
    exported = load_exported(tmp_path / "tied").load()
    embedding, linear = getattr(exported, "0"), getattr(exported, "1")
    assert linear.weight is embedding.weight
    assert not embedding.weight.requires_grad
    assert list(exported.state_dict()) == list(model.state_dict())


class WithConstant(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 3)

    def forward(self, x):
        return self.fc(x) * torch.tensor([1.0, 2.0, 3.0])  # a tracer constant, not state


def test_tracer_constants_go_to_constants_pt_not_state_dict(tmp_path):
    model, x = WithConstant(), torch.randn(2, 4)
    gm = fxopt.optimize(model, x, verify=False)
    result = export(gm, tmp_path / "const", example_inputs=x)
    assert "constants.pt" in result.files and result.verification.ok
    constants = torch.load(tmp_path / "const" / "constants.pt", weights_only=True)
    assert [t.tolist() for t in constants.values()] == [[1.0, 2.0, 3.0]]
    assert list(load_exported(tmp_path / "const").load().state_dict()) == ["fc.weight", "fc.bias"]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.cuda
def test_cuda_model_exports_to_cpu_weights_and_loads_on_cuda(tmp_path):
    torch.manual_seed(0)
    model, x = conv_stack().cuda(), torch.randn(2, 3, 16, 16, device="cuda")
    gm = fxopt.optimize(model, x, memory_budget=0.7, verify=False)
    result = export(gm, tmp_path / "cuda", example_inputs=x)  # verified on the GPU
    assert result.verification.ok and result.regions >= 1
    weights = torch.load(tmp_path / "cuda" / "state_dict.pt", weights_only=True)
    assert all(t.device.type == "cpu" for t in weights.values())
    exported = load_exported(tmp_path / "cuda").load(map_location="cuda")
    assert next(exported.parameters()).is_cuda
    with torch.no_grad():
        torch.testing.assert_close(exported.eval()(x), copy.deepcopy(model).eval()(x))


class TrainOnlyBranch(nn.Module):
    """forward's Python code depends on self.training: fxopt keeps a graph per mode."""

    def __init__(self):
        super().__init__()
        self.lin, self.bn = nn.Linear(4, 4), nn.BatchNorm1d(4)

    def forward(self, x):
        y = self.bn(self.lin(x))
        if self.training:
            y = y * 2
        return nn.functional.dropout(y, 0.3, self.training)


def test_mode_dependent_forward_exports_both_graphs(tmp_path):
    model, x = TrainOnlyBranch(), torch.randn(3, 4)
    gm = fxopt.optimize(model, (x,), verify=False)
    assert gm.fxopt_report.trace.mode_dependent
    result = export(gm, tmp_path / "out", example_inputs=(x,))
    assert result.verification.ok and result.verification.checked["eval_output"] == 1
    source = (tmp_path / "out" / "model.py").read_text()
    assert "fxopt_eval_forward" not in source and "import fxopt" not in source
    assert "return self._forward_eval(x)" in source
    loaded = load_exported(tmp_path / "out").load()
    model.eval(), loaded.eval()
    torch.testing.assert_close(loaded(x), model(x), rtol=0, atol=0)


def test_generated_code_imports_public_torch_only_and_checks_the_torch_release(
        exports, monkeypatch):
    """model.py imports no private torch module; under another torch release it refuses to
    import with an error saying what to do, unless FXOPT_ALLOW_OTHER_TORCH is set (patch
    releases load as they are)."""
    root, _, results = exports
    for name in results:
        source = (root / name / "model.py").read_text()
        imported = [line for line in source.splitlines() if line.startswith(("import ", "from "))]
        assert not [line for line in imported if "._" in line or " _" in line.split("import")[0]]
        assert f"TORCH_VERSION = {str(torch.__version__)!r}" in source
    major, minor = str(torch.__version__).split(".")[:2]
    monkeypatch.delenv(fxopt.export.codegen.ALLOW_OTHER_TORCH, raising=False)
    monkeypatch.setattr(torch, "__version__", f"{major}.{minor}.99")
    load_exported(root / "plain")  # another patch release: fine
    monkeypatch.setattr(torch, "__version__", f"{major}.{int(minor) + 1}.0")
    with pytest.raises(ImportError, match=r"exported by fxopt with torch .* Export the model "
                                          r"again with this torch"):
        load_exported(root / "plain")
    monkeypatch.setenv(fxopt.export.codegen.ALLOW_OTHER_TORCH, "1")
    assert load_exported(root / "plain").load() is not None



def test_the_exported_module_refuses_what_its_code_would_ignore(tmp_path):
    """The generated code runs most submodules inline (their tensors read by name, in the mode
    of the code running them): a hook registered on one of those after loading never ran, a
    module replaced there was never run, and a BatchNorm frozen inside a training block kept
    using batch statistics, silently. The copied ``fxopt.runtime.inline_guard`` now refuses each
    before any compute with the copied runtime's ``ConfigError``; a hook on a block the code
    calls runs, a whole block frozen runs its eval-mode code as the model does, and a deep copy
    keeps the guard."""
    import torchvision

    torch.manual_seed(0)
    model, x = torchvision.models.resnet18(num_classes=10), torch.randn(2, 3, 32, 32)
    gm = fxopt.optimize(model, x, capture="export", memory_budget="min", verify=False,
                        predict_memory=False)
    export(gm, tmp_path / "out", example_inputs=(x,))
    loaded = load_exported(tmp_path / "out").load()
    source = (tmp_path / "out" / "model.py").read_text()
    assert "InlineGuard(self, {" in source and "import fxopt" not in source

    def refused(module, match):
        with pytest.raises(Exception, match=match) as caught:
            module(x)
        assert type(caught.value).__name__ == "ConfigError"
        assert not isinstance(caught.value, fxopt.ConfigError)  # the folder's own copy
        return caught.value

    handle = loaded.layer4.register_forward_hook(lambda *args: None)
    error = refused(loaded, "layer4 has forward hooks, but the exported code never calls it")
    assert error.where == "layer4 (Sequential)"
    handle.remove()
    seen = []
    handle = loaded.layer4[0].register_forward_hook(lambda *args: seen.append(1))
    loaded(x)
    assert seen == [1]
    handle.remove()

    reference = copy.deepcopy(model)
    reference.load_state_dict(loaded.state_dict())  # the calls above updated running statistics
    for module in (reference, loaded):
        module.layer1[0].bn1.eval()
    refused(loaded, "layer1.0.bn1 is in eval mode while layer1.0, a block the code calls, is in "
                    "train mode")
    for module in (reference, loaded):
        module.layer1[0].eval()
    torch.testing.assert_close(loaded(x), reference(x))

    copied = copy.deepcopy(loaded)
    copied.layer1[0].conv1 = nn.Conv2d(64, 64, 3, padding=1, bias=False)
    refused(copied, "layer1.0.conv1 is a Conv2d now, where fxopt.export wrote a Module")
