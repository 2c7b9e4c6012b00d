"""``fxopt optimize --out`` on a Hugging Face causal LM captured by torch.export (issue 22, item 7):
the folder loads and trains in a Python that cannot import fxopt, with the loss and gradients of
the original model; the memory breakdown works on the export-captured model; a failed export
leaves no folder behind and an existing one as it was, and says it is an export error."""

import copy
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

import fxopt
import fxopt.api
import fxopt.export.codegen
from fxopt.cli import commands as cli
from fxopt.cli import targets
from fxopt.cli.inputs import parse_input_spec
from fxopt.cli.targets import load_target
from fxopt.measure.breakdown import memory_breakdown
from helpers import TINY_LLAMA_SOURCE, TINY_LLAMA_VOCAB

transformers = pytest.importorskip("transformers")

REPO = Path(__file__).resolve().parent.parent
VOCAB, SEQ = TINY_LLAMA_VOCAB, 16
LM = TINY_LLAMA_SOURCE
INPUTS = [f"input_ids=2,{SEQ}:int64:0-{VOCAB}", "labels=@input_ids"]
RUNS = {"plain": [], "min": ["--memory-budget", "min"],
        "min_loss": ["--memory-budget", "min", "--outputs", "loss"]}  # logits not built


def _expected(model, kwargs: dict) -> dict:
    """One training step of the user's model: loss, gradients, and the loss after an SGD step."""
    model.train()
    torch.manual_seed(0)
    loss = model(**kwargs).loss
    loss.backward()
    grads = {name: p.grad.clone() for name, p in model.named_parameters()}
    with torch.no_grad():
        for p in model.parameters():
            p -= 0.1 * p.grad
    torch.manual_seed(0)
    after = model(**kwargs).loss.detach()
    return {"loss": loss.detach(), "grads": grads, "loss_after_step": after}


@pytest.fixture(scope="module")
def llama_exports(tmp_path_factory):
    """The CLI's exports of one tiny Llama (no budget, ``--memory-budget min``, and with
    ``--outputs loss``), the optimized modules it built (kept by wrapping ``fxopt.api.optimize``)
    and what a fresh process must reproduce.

    The three runs share one capture (three torch.export traces, most of a run's time): the first
    run loads the target from its file, the later ones get the model and inputs it loaded
    (``optimize`` leaves them as they were), and each ``optimize`` the CLI calls starts from
    ``fxopt.capture_model``'s capture of that model, made with the CLI's capture options."""
    root = tmp_path_factory.mktemp("hf_exports")
    (root / "hf_causal_lms.py").write_text(LM)
    target = f"{root / 'hf_causal_lms.py'}:llama"
    model, inputs = load_target(target, input_specs=[parse_input_spec(s) for s in INPUTS])
    kwargs = {"input_ids": inputs[0], "labels": inputs[-1]}
    assert torch.equal(kwargs["labels"], kwargs["input_ids"])
    torch.save({"kwargs": kwargs, "state": {k: v.clone() for k, v in model.state_dict().items()}},
               root / "given.pt")
    optimized, real_optimize, real_load = {}, fxopt.api.optimize, targets.load_target
    loaded, captures = [], []

    def load_once(*args, **kw):
        if not loaded:
            loaded.append(real_load(*args, **kw))
        return loaded[0]

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(targets, "load_target", load_once)
        for name, extra in RUNS.items():
            def keep(cli_model, cli_inputs, *, _name=name, **kw):
                assert cli_model is loaded[0][0] and cli_inputs is loaded[0][1]
                if not captures:
                    captures.append(fxopt.capture_model(
                        cli_model, cli_inputs, capture=kw["capture"],
                        leaf_modules=kw["leaf_modules"], dynamic=kw["dynamic"]))
                optimized[_name] = real_optimize(cli_model, cli_inputs, captured=captures[0],
                                                 **kw)
                return optimized[_name]

            patch.setattr(fxopt.api, "optimize", keep)
            argv = ["optimize", target, *[a for s in INPUTS for a in ("--input", s)], *extra,
                    "--out", str(root / name), "--repeats", "1", "--threads", "1",
                    "--no-verify"]
            assert cli.main(argv) == 0, name
    cli_model, cli_inputs = loaded[0]  # as the file built them, so each run got the same
    assert torch.equal(cli_inputs[0], kwargs["input_ids"])
    assert all(torch.equal(value, model.state_dict()[key])
               for key, value in cli_model.state_dict().items())
    torch.save(_expected(copy.deepcopy(model), kwargs), root / "expected.pt")
    return root, target, model, kwargs, optimized


def test_both_exports_are_written_and_verified(llama_exports):
    root, _, _, _, optimized = llama_exports
    for name in RUNS:
        assert optimized[name].fxopt_report.trace.frontend == "export", name
        document = json.loads((root / name / "report.json").read_text())
        assert document["export"]["verification"]["ok"] is True, name
        manifest = json.loads((root / name / "manifest.json").read_text())
        assert manifest["needs"] == ["transformers.modeling_outputs"]
        assert "constants.pt" in manifest["files"]  # the rotary inv_freq (non-persistent)
        source = (root / name / "model.py").read_text()
        assert "import fxopt" not in source and "_GraphBody" in source
    assert json.loads((root / "min" / "manifest.json").read_text())["regions"] >= 1
    assert not [p.name for p in root.iterdir() if p.name.startswith(".")]  # no staging left


def test_the_folders_load_and_train_where_fxopt_cannot_be_imported(llama_exports, tmp_path):
    root, *_ = llama_exports
    script = textwrap.dedent(f"""
        import importlib.util, sys
        for name in ('fxopt', 'passes', 'models_zoo'):
            sys.modules[name] = None  # any import of them fails
        sys.path[:] = [p for p in sys.path if p not in ('', '.', {str(REPO)!r})]
        import torch
        given = torch.load({str(root / 'given.pt')!r}, weights_only=True)
        expected = torch.load({str(root / 'expected.pt')!r}, weights_only=True)
        for name in {list(RUNS)!r}:
            sys.path.insert(0, {str(root)!r})
            package = __import__(name)
            model = package.load()
            model.load_state_dict(given['state'])
            model.train()
            torch.manual_seed(0)
            loss = model(**given['kwargs']).loss
            loss.backward()
            torch.testing.assert_close(loss.detach(), expected['loss'])
            grads = dict(model.named_parameters())
            assert set(grads) == set(expected['grads']), name
            for key, value in expected['grads'].items():
                torch.testing.assert_close(grads[key].grad, value, msg=f'{{name}}: {{key}}')
            optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
            optimizer.step()
            torch.manual_seed(0)
            after = model(**given['kwargs']).loss
            torch.testing.assert_close(after.detach(), expected['loss_after_step'])
        assert not [m for m in sys.modules if m.split('.')[0] in ('fxopt', 'passes', 'models_zoo')
                    and sys.modules[m] is not None]
        print('ok')
    """)
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME")}
    done = subprocess.run([sys.executable, "-c", script], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=180)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.strip() == "ok"


def test_transformers_trainer_trains_an_exported_folder_and_its_checkpoints_load_as_the_original(
        llama_exports, tmp_path):
    """The module an ``--out`` folder loads is a plain ``nn.Module``, not a ``PreTrainedModel``:
    ``Trainer`` trains it, saves each checkpoint as a bare state dict under the original's keys,
    and resuming from one repeats the next step exactly; that state dict, with the original's
    ``config.json`` written beside it, loads with ``from_pretrained`` (docs/cli.md)."""
    import importlib.util

    from safetensors.torch import load_file

    root, _, model, kwargs, _ = llama_exports
    spec = importlib.util.spec_from_file_location("exported_min", root / "min" / "model.py")
    exported = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(exported)
    rows = [{"input_ids": ids, "labels": ids} for ids in torch.randint(
        0, VOCAB, (8, SEQ), generator=torch.Generator().manual_seed(1))]

    def train(resume_from=None):
        net = exported.load()
        args = transformers.TrainingArguments(
            output_dir=str(tmp_path), per_device_train_batch_size=2, learning_rate=1e-2,
            max_steps=3, save_steps=1, logging_steps=1, seed=0, report_to=[], use_cpu=True,
            disable_tqdm=True)
        trainer = transformers.Trainer(model=net, args=args, train_dataset=rows)
        trainer.train(resume_from_checkpoint=resume_from)
        return net, {h["step"]: h["loss"] for h in trainer.state.log_history if "loss" in h}

    net, losses = train()
    assert list(losses) == [1, 2, 3]
    last = tmp_path / "checkpoint-3"
    assert not (last / "config.json").exists()  # a bare state dict
    saved = load_file(last / "model.safetensors")
    assert sorted(saved) == sorted(model.state_dict())  # safetensors orders keys by name
    for name, value in net.state_dict().items():
        assert torch.equal(saved[name], value), name

    _, resumed = train(resume_from=str(tmp_path / "checkpoint-2"))
    assert resumed == losses  # steps 1-2 from the checkpoint's history, step 3 run again

    model.config.save_pretrained(last)
    loaded = type(model).from_pretrained(last)
    for name, value in loaded.state_dict().items():
        assert torch.equal(value, saved[name]), name


def test_memory_breakdown_of_the_export_captured_llama(llama_exports):
    _, _, model, kwargs, optimized = llama_exports
    inputs = (kwargs["input_ids"], None, None, None, None, kwargs["labels"])
    parameters = {name.replace(".", "_") for name, _ in model.named_parameters()}
    for gm in optimized.values():
        for breakdown in (memory_breakdown(model, inputs, gm=gm), memory_breakdown(gm, inputs)):
            assert breakdown.train.peak_bytes > breakdown.train.params_bytes > 0
            assert breakdown.saved and breakdown.saved_bytes > 0
            # parameters an ATen graph reads by get_attr are counted as parameters, not saved
            assert not [s.value for s in breakdown.saved if s.value in parameters]
            text = breakdown.format(top=100)
            assert "saved for backward" in text and "(LlamaRMSNorm)" in text
            assert "torch.nn.modules" not in text and "transformers.models" not in text


def _planted_codegen_bugs(monkeypatch, where: str) -> None:
    """A bug in the code generation: a crash while generating (nothing written yet), or code
    that fails when the written folder is loaded back (everything written by then)."""
    if where == "generating":
        def crash(self, graph, what, name="forward"):
            raise RuntimeError("planted codegen bug")

        monkeypatch.setattr("fxopt.export.names.Imports.forward_source", crash)
    else:
        monkeypatch.setattr("fxopt.export.codegen.HEADER", fxopt.export.codegen.HEADER +
                            "\nraise RuntimeError('planted codegen bug')\n")


def test_a_failed_export_leaves_nothing_and_keeps_the_users_folder(tmp_path, capsys,
                                                                    monkeypatch):
    """Exit 3, an export error (not a pass's), the optimization's table still printed, no folder
    or staging folder left, and an existing --out folder untouched."""
    users = tmp_path / "users"
    users.mkdir()
    (users / "notes.txt").write_text("mine")
    (users / "model.py").write_text("# an earlier export")
    before = {p.name: p.read_bytes() for p in users.iterdir()}
    for out, where in ((users, "loading"), (tmp_path / "new" / "deeper", "loading"),
                       (users, "generating")):
        with monkeypatch.context() as patch:
            _planted_codegen_bugs(patch, where)
            code = cli.main(["optimize", "zoo:mlp", "--out", str(out), "--repeats", "1",
                             "--threads", "1", "--no-verify"])
        printed, err = capsys.readouterr()
        assert code == 3, err
        assert err.startswith("fxopt: cannot export ") and "planted codegen bug" in err, err
        what = err.split("what to do:")[0]
        assert "pass" not in what and "bisect" not in err and "Traceback" not in err
        assert "bug in fxopt's export" in err
        assert "train peak, measured" in printed  # what the optimization achieved
        assert {p.name: p.read_bytes() for p in users.iterdir()} == before
        assert sorted(p.name for p in tmp_path.iterdir()) == ["users"], where


def test_the_input_guard_is_rebuilt_from_its_constructor_fields(llama_exports):
    """The exported guard is the constructor call of every field ``InputGuard.__init__`` takes
    (checks and state included), read generically, so a new field is exported too."""
    import importlib
    import inspect

    from fxopt.export.codegen import _constructor_arguments, _guard_source
    from fxopt.export.names import Imports
    from fxopt.runtime.input_guard import InputGuard

    *_, optimized = llama_exports
    guard = optimized["plain"]._fxopt_input_guard
    assert guard.checks and guard.state
    imports = Imports()
    source = _guard_source(guard, imports, "guard")
    for name in inspect.signature(InputGuard).parameters:
        assert f"{name}=" in source, name
    namespace = {alias: importlib.import_module(module)
                 for module, alias in imports._modules.items()}
    assert eval(source, {"torch": torch, **namespace}) == guard

    class Wider(InputGuard):
        def __init__(self, model_name, params, tensors, ranges, *, checks=(), state=(),
                     extra=(), later=None):
            super().__init__(model_name, params, tensors, ranges, checks=checks, state=state)
            self.extra = tuple(extra)

    wider = Wider(guard.model_name, guard.params, guard.tensors, guard.ranges,
                  extra=(1, 2))
    arguments = _constructor_arguments(wider, repr, "guard")
    assert "extra=(1, 2)" in arguments and not [a for a in arguments if "later" in a]
