"""fxopt makes every tensor where the model is: CPU tests that catch the wrong-device class of bug.

On a GPU, fxopt first crashed on a reference mask built on the CPU for a CUDA model (review D1).
On a CPU test machine such a tensor lands where the model is by accident. Under
``default_device_elsewhere()`` (``tests/device_mode.py``) a tensor made without naming a device
is a meta tensor, so mixing it with the model's CPU tensors raises as on the GPU. Every test
here builds the model and inputs first and runs fxopt's own work inside that mode:

- ``fxopt.optimize`` with the default pipeline and with ``memory_budget="min"`` over the zoo and
  Hugging Face / diffusers models (verification included: both training steps, the cotangents,
  the checkpointed regions' recomputation in backward run for real);
- ``fxopt.verify``, ``fxopt.measure``, ``fxopt.estimate_peak`` and ``fxopt.export`` (written,
  imported back and verified) on optimized modules;
- the device-following of export graphs (``fxopt.capture.export_devices``): no graph an
  optimized module runs (train and eval graphs, blocks, region and scoped bodies) keeps the
  capture device as a literal, nor does the exported ``model.py``, and the graphs run forward on
  fake tensors of *another* device (``cuda:1``, no GPU needed; backward cannot run that way)
  with every tensor they make there;
- opaque leaves replayed (or stood in for) on fakes of another device; cotangents drawn in
  chunks against one draw;
- a training step of the optimized modules at ``"min"`` moved to ``meta`` tensors, backward
  included: autograd runs backward (checkpointed regions' recomputation, the chunked loss's
  backward) outside ``default_device_elsewhere``, so only a run on another device reaches a
  tensor made there without a device.

Which models, with the smallest inputs that exercise them (the suite has a time budget): every
zoo model in both configurations but those whose path another one already takes --
``resnet50``/``resnet152`` (``resnet18``'s torchvision ResNet), ``densenet121`` (torchvision
conv/BatchNorm/concat, as ``resnet18`` and ``unet``; 30 s of CPU alone) and ``mobilenet_v2``
(its depthwise convolutions are ``grouped_cnn``'s). Among the ecosystem models (an export
capture alone costs seconds of CPU), ``"min"`` runs the default passes too (it adds
checkpointing and the chunked loss): Llama at ``"min"`` (and it is the module the verify,
measure, estimate, export and other-device tests share), GPT-2, Gemma 2 (sliding
windows, soft-capping, built from a tiny config) and BERT (a padded mask) with the default
pipeline, and a diffusers UNet at ``"min"`` (``diffusers_unet2d``'s code with one down and one
up block and no attention, which the LMs cover). The causal LMs are fed ``input_ids`` and
``labels`` as in pretraining, so the causal-mask planner evaluates their masks (the crash on
the H200, review D1: with the reference mask built without a device, Llama and GPT-2 fail
here with that ``PassError``). Qwen2 and Mistral take Llama's path. ``FXOPT_DEVICE_SAFETY_FULL=1``
runs every zoo model, and every ecosystem model named here in both configurations.
"""

from __future__ import annotations

import copy
import os
import warnings

import pytest
import torch
from torch import nn

import fxopt
from device_mode import baked_devices, default_device_elsewhere, graphs_of
from fxopt.capture.export_devices import device_types_built_in
from fxopt.capture.export_frontend import capture_with_export
from fxopt.core.inputs import check_inputs
from fxopt.core.step import COTANGENT_SEED, _draw_into, cotangents_for, training_step
from fxopt.core.torch_private import FakeTensorMode, tree_leaves
from fxopt.export import export, load_exported
from fxopt.runtime.devices import tensor_device
from fxopt.runtime.input_guard import InputGuard
from fxopt.models_zoo import registry
from fxopt.verify.fused_training import verify_fused_training
from fxopt.verify.tensor_diff import DEFAULT_TOLERANCES, compare_named
from helpers import WideMLP, seeded

FULL = os.environ.get("FXOPT_DEVICE_SAFETY_FULL") == "1"
BUDGETS = (None, "min")
ELSEWHERE = "cuda:1"  # a device the fake-tensor runs move the model to; no GPU needed

# -- models: built on the CPU, outside the mode, with the smallest inputs that exercise them

ZOO_SHAPES = {"mlp": (2, 784), "mnist_net": (2, 1, 28, 28), "odd_channel_cnn": (2, 3, 16, 16),
              "grouped_cnn": (2, 3, 16, 16), "transformer_block": (1, 8, 64),
              "unet": (1, 3, 16, 16), "resnet18": (2, 3, 32, 32)}
ZOO_SKIPPED = {"resnet50": "resnet18", "resnet152": "resnet18", "densenet121": "resnet18, unet",
               "mobilenet_v2": "grouped_cnn, resnet18"}
ZOO = [n for n in registry.names() if FULL or n not in ZOO_SKIPPED]


def zoo_case(name: str) -> tuple[nn.Module, tuple, dict]:
    entry = registry.get(name)
    if name == "transformer_lm":
        return entry.build(), (torch.randint(0, 1000, (1, 8)),), {}
    if name in ZOO_SHAPES:
        generator = torch.Generator().manual_seed(0)
        return entry.build(), (torch.randn(ZOO_SHAPES[name], generator=generator),), {}
    return entry.build(), entry.example_inputs(2), {}


def _lm_kwargs(vocab: int = 1000, batch: int = 2, seq: int = 16) -> dict:
    ids = torch.randint(4, vocab, (batch, seq), generator=torch.Generator().manual_seed(0))
    return {"input_ids": ids, "labels": ids.clone()}


def _built(factory) -> nn.Module:
    with torch.random.fork_rng(devices=[]), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.random.default_generator.manual_seed(0)
        return factory().train()


def hf_case(name: str) -> tuple[nn.Module, tuple, dict]:
    transformers = pytest.importorskip("transformers")
    from fxopt.models_zoo import ecosystem

    if name == "gemma2":
        config = transformers.Gemma2Config(**ecosystem._LM, num_key_value_heads=2, head_dim=8,
                                           sliding_window=8, use_cache=False)
        return _built(lambda: transformers.Gemma2ForCausalLM(config)), (), _lm_kwargs()
    if name == "unet2d":  # models_zoo's diffusers_unet2d with one block and no attention
        diffusers = pytest.importorskip("diffusers")
        model = _built(lambda: diffusers.UNet2DModel(
            sample_size=8, in_channels=3, out_channels=3, layers_per_block=1,
            block_out_channels=(16,), down_block_types=("DownBlock2D",),
            up_block_types=("UpBlock2D",), norm_num_groups=4, add_attention=False))
        generator = torch.Generator().manual_seed(0)
        return model, (torch.randn(2, 3, 8, 8, generator=generator),
                       torch.randint(0, 1000, (2,), generator=generator)), {}
    entry = ecosystem.get(name)
    if name.endswith("_lm"):
        return entry.build(), (), _lm_kwargs()
    args, kwargs = entry.inputs(2)
    return entry.build(), args, kwargs


HF = [("hf_llama_lm", "min"), ("hf_gpt2_lm", None), ("gemma2", None), ("hf_bert", None),
      ("unet2d", "min")]
if FULL:
    HF += [(n, b) for n in ("hf_llama_lm", "hf_gpt2_lm", "hf_qwen2_lm", "hf_mistral_lm", "gemma2",
                            "hf_bert", "diffusers_unet2d")
           for b in BUDGETS if (n, b) not in HF]


def optimized(model: nn.Module, args: tuple, kwargs: dict, budget: str | None) -> nn.Module:
    with default_device_elsewhere():
        return fxopt.optimize(model, args, example_kwargs=kwargs or None, memory_budget=budget)


# -- the mode itself


def test_the_mode_makes_a_tensor_without_a_device_fail_against_the_models():
    """The premise: inside the mode, a tensor made without a device cannot meet a CPU one."""
    model = nn.Linear(4, 4)
    x = torch.randn(2, 4)
    with default_device_elsewhere():
        assert torch.ones(2).device.type == "meta"
        assert model(x).device.type == "cpu"  # the model's own work is untouched
        with pytest.raises((RuntimeError, NotImplementedError)):
            torch.equal(model(x), torch.zeros(2, 4))
    assert torch.ones(1).device.type == "cpu"


# -- optimize over the models


def _cached(build):
    cache: dict = {}

    def get(name: str, budget: str | None):
        if (name, budget) not in cache:
            model, args, kwargs = build(name)
            gm = optimized(model, args, kwargs, budget)
            cache[name, budget] = (model, check_inputs(model, args, kwargs), gm)
        return cache[name, budget]

    return get


@pytest.fixture(scope="module")
def zoo_optimized():
    """name, budget -> (model, args, optimized module), shared by the tests below."""
    return _cached(zoo_case)


@pytest.fixture(scope="module")
def hf_optimized():
    """name, budget -> (model, bound args, optimized module), shared by the tests below."""
    return _cached(hf_case)


@pytest.mark.parametrize("budget", BUDGETS, ids=["default", "min"])
@pytest.mark.parametrize("name", ZOO)
def test_zoo_models_optimize_with_the_default_device_elsewhere(zoo_optimized, name, budget):
    _, _, gm = zoo_optimized(name, budget)
    assert gm.fxopt_report.verification is not None


@pytest.mark.parametrize("name, budget", HF, ids=[f"{n}-{b or 'default'}" for n, b in HF])
def test_ecosystem_models_optimize_and_follow_the_device(hf_optimized, name, budget):
    """Optimized under the mode, verified; no graph it runs names the capture device, nor any
    device type, so the module may move to another device type as a whole (a portable guard)."""
    _, _, gm = hf_optimized(name, budget)
    assert gm.fxopt_report.verification is not None
    assert gm.fxopt_report.trace.frontend == "export"
    assert baked_devices(gm) == []
    assert device_types_built_in(gm) == [] and gm._fxopt_input_guard.portable
    modified = {p.name for p in gm.fxopt_report.passes if p.modified}
    if name in ("hf_llama_lm", "hf_gpt2_lm"):  # the causal-mask planner ran on their masks
        assert "causal_attention" in modified
    if name in ("hf_llama_lm", "unet2d") and budget == "min":  # regions ran in backward
        assert "checkpoint" in modified


# -- verify, measure, estimate_peak, export under the mode


def test_verify_measure_and_estimate_with_the_default_device_elsewhere(hf_optimized,
                                                                      zoo_optimized):
    """On an export-captured LM and an fx-captured U-Net (BatchNorm), both checkpointed."""
    cases = (hf_optimized("hf_llama_lm", "min"), zoo_optimized("unet", "min"))  # built on CPU
    with default_device_elsewhere():
        for reference, inputs, candidate in cases:
            assert fxopt.verify(reference, candidate, inputs).ok
            report = fxopt.measure(candidate, inputs)
            estimate = fxopt.estimate_peak(candidate, inputs)
            assert report.train.peak_bytes > 0 and estimate.train_bytes > 0


def test_export_with_the_default_device_elsewhere_names_no_device(hf_optimized, tmp_path):
    """The exported model.py of an export-captured, checkpointed LM names no device; written,
    imported back and verified under the mode."""
    _, args, gm = hf_optimized("hf_llama_lm", "min")
    with default_device_elsewhere():
        result = export(gm, tmp_path / "llama", example_inputs=args)
    assert result.verification is not None
    source = (tmp_path / "llama" / "model.py").read_text()
    assert "device(type=" not in source
    assert "tensor_device" in source
    with default_device_elsewhere():  # load() builds on map_location, not the default device
        loaded = load_exported(tmp_path / "llama").load()
    assert {t.device.type for t in [*loaded.parameters(), *loaded.buffers()]} == {"cpu"}
    # D4, the other way round: captured on the CPU, loaded on another device type, it runs
    # there (the GPU case: captured on cuda, loaded with map_location="cpu").
    elsewhere = load_exported(tmp_path / "llama").load(map_location="meta")
    with torch.no_grad():
        out = elsewhere.eval()(*(a.to("meta") if isinstance(a, torch.Tensor) else a
                                 for a in args))
    assert out.logits.device.type == "meta"


# -- factory ops follow the module (D3/D4)


def guard_off(monkeypatch) -> None:
    """The input guard let through: for a module whose graph names its capture's device type (an
    autocast scope), which the guard refuses on another device type before any compute."""
    monkeypatch.setattr(InputGuard, "__call__", lambda self, *values, state=(): None)


def _fake_forward(gm: nn.Module, args: tuple, device: str, training: bool) -> list:
    """``gm``'s forward on fake tensors on ``device``: its parameters, buffers and inputs
    there (the guard left out: ``guard_off`` where a graph names its device type)."""
    with FakeTensorMode(allow_non_fake_inputs=True):
        state = {name: torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device=device,
                                           requires_grad=t.requires_grad)
                 for name, t in [*gm.named_parameters(), *gm.named_buffers()]}
        inputs = tuple(torch.zeros(a.shape, dtype=a.dtype, device=device)
                       if isinstance(a, torch.Tensor) else a for a in args)
        gm.train(training)
        try:
            with torch.set_grad_enabled(training):
                out = torch.func.functional_call(gm, state, inputs)
        finally:
            gm.train()
        return [t for t in tree_leaves(out) if isinstance(t, torch.Tensor)]


class Factories(nn.Module):
    """Makes tensors on its input's device every way export records a device: factory ops,
    ``.to(device)``, a factory inside an autocast scope whose body has no tensor input (so the
    body gets the device as an input of its own), a ``no_grad`` scope, a tensor built from a
    literal (a lifted constant), and dropout (so the train and eval graphs differ)."""

    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(8, 8)
        self.register_buffer("inv_freq", torch.linspace(0.1, 1.0, 4))
        self.drop = nn.Dropout(0.1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        T = x.shape[1]
        pos = torch.arange(T, device=x.device)
        with torch.autocast(device_type=x.device.type, enabled=False):
            table = torch.ones(T, 4, device=x.device).cumsum(0)
        with torch.no_grad():
            freqs = pos.to(self.inv_freq.device, torch.float32)[:, None] * self.inv_freq
        mask = torch.tril(torch.ones(T, T, device=x.device, dtype=torch.bool))
        scale = torch.tensor([0.5, 1.0, 1.5, 2.0] * 2, device=x.device)
        h = self.drop(self.proj(x)) * scale
        h = h + (mask.float() @ h) / T
        return h + (table + freqs).sum(-1, keepdim=True)


def _reads_devices(gm: nn.Module) -> int:
    return sum(node.target is tensor_device for _, graph in graphs_of(gm) for node in graph.nodes)


@pytest.mark.parametrize("budget", BUDGETS, ids=["captured", "min"])
def test_factory_ops_follow_the_module_to_another_device(monkeypatch, budget):
    """Captured (and optimized) under the mode: no literal CPU device in any graph, the same
    numbers as the model, and run forward on fake tensors of another device in train and eval
    mode, every output is there: every factory op, ``.to`` and ``_assert_tensor_metadata``
    followed the parameters, in the scoped bodies and for the lifted constant too."""
    torch.manual_seed(0)
    model = Factories()
    x = torch.randn(2, 5, 8)
    with default_device_elsewhere():
        gm = (capture_with_export(model, (x,)) if budget is None
              else fxopt.optimize(model, (x,), memory_budget=budget))
    assert baked_devices(gm) == [] and _reads_devices(gm) > 0
    model.eval(), gm.eval()
    other = torch.randn(3, 7, 8)
    assert torch.equal(gm(other), model(other))
    guard_off(monkeypatch)
    for training in (True, False):
        outputs = _fake_forward(gm, (other,), ELSEWHERE, training)
        assert outputs and {str(t.device) for t in outputs} == {ELSEWHERE}


def test_an_optimized_language_model_runs_on_another_device(hf_optimized):
    """An export-captured Llama at "min" (kept blocks, checkpointed regions, chunked loss) run
    forward on fake tensors of another device, in train and eval mode."""
    _, args, gm = hf_optimized("hf_llama_lm", "min")
    assert _reads_devices(gm) > 0  # the guard is portable: it lets the whole module move
    for training in (True, False):
        outputs = _fake_forward(gm, args, ELSEWHERE, training)
        assert outputs and {str(t.device) for t in outputs} == {ELSEWHERE}


def _train_on_meta(gm: nn.Module, args: tuple) -> list[torch.Tensor]:
    """A copy of ``gm`` and ``args`` moved to ``meta``, one training step there, then an
    evaluation forward (eval mode, no grad: regions run their bodies plainly); the copy's
    parameter gradients. A tensor made on the CPU in backward (a region's recomputation, a
    custom backward) meets the meta ones and raises: autograd runs backward outside
    ``default_device_elsewhere``, so this is the check that reaches it. An export-captured
    module's guard lets it move: its graphs name no device type."""
    moved = copy.deepcopy(gm).to("meta")
    inputs = tuple(a.to("meta") if isinstance(a, torch.Tensor) else a for a in args)
    training_step(moved, inputs)
    moved.eval()
    with torch.no_grad():
        outputs = [t for t in tree_leaves(moved(*inputs)) if isinstance(t, torch.Tensor)]
    assert outputs and {t.device.type for t in outputs} == {"meta"}
    return [p.grad for p in moved.parameters() if p.grad is not None]


@pytest.mark.parametrize("name", ZOO)
def test_zoo_models_at_min_train_on_meta_tensors_backward_included(zoo_optimized, name):
    _, args, gm = zoo_optimized(name, "min")
    grads = _train_on_meta(gm, args)
    assert grads and {g.device.type for g in grads} == {"meta"}


@pytest.mark.parametrize("name", ["hf_llama_lm", "unet2d"])
def test_ecosystem_models_at_min_train_on_meta_tensors_backward_included(hf_optimized, name):
    """Llama's checkpointed regions, kept blocks and chunked loss; the diffusers UNet's
    regions: forward and backward on meta tensors."""
    _, args, gm = hf_optimized(name, "min")
    assert "checkpoint" in {p.name for p in gm.fxopt_report.passes if p.modified}
    grads = _train_on_meta(gm, args)
    assert len(grads) == len([p for p in gm.parameters() if p.requires_grad])
    assert {g.device.type for g in grads} == {"meta"}


def test_the_guard_refuses_a_module_or_inputs_split_across_device_types():
    """Same type, other index follows; a whole module moves to another device type (its graph
    names none), but inputs left behind, or a module moved in parts, are refused before any
    compute."""
    model = nn.Linear(4, 4)
    gm = capture_with_export(model, (torch.randn(2, 4),))
    assert gm._fxopt_input_guard.portable
    with pytest.raises(fxopt.InputError, match="on cpu; this call gives torch.float32 on meta"):
        gm(torch.randn(2, 4, device="meta"))
    moved = copy.deepcopy(gm).to("meta")
    assert moved(torch.randn(2, 4, device="meta")).device.type == "meta"
    with pytest.raises(fxopt.InputError, match=r"on meta \(where the module is\)"):
        moved(torch.randn(2, 4))
    moved.bias = nn.Parameter(torch.zeros(4))  # the bias back on the CPU alone
    with pytest.raises(fxopt.InputError, match="are now on meta and cpu"):
        moved(torch.randn(2, 4, device="meta"))


def test_random_inputs_are_the_same_whatever_the_default_device():
    """``fxopt.check``'s and the CLI's random inputs: drawn on the CPU from their generator."""
    from fxopt.check import random_inputs_like
    from fxopt.cli.inputs import draw

    like = (torch.randn(2, 3), torch.randint(0, 7, (4,)), torch.zeros(2, dtype=torch.bool))
    expected = random_inputs_like(like, seed=3, batch_size=5)
    drawn = draw((2, 3), torch.float32, torch.Generator().manual_seed(0), int_range=None)
    with default_device_elsewhere():
        again = random_inputs_like(like, seed=3, batch_size=5)
        drawn_again = draw((2, 3), torch.float32, torch.Generator().manual_seed(0))
    assert all(torch.equal(a, e) for a, e in zip(again, expected))
    assert torch.equal(drawn_again, drawn)


# -- cotangents (C1)


@pytest.mark.parametrize("chunk", [16, 32, 4096])
def test_cotangents_drawn_in_chunks_are_the_numbers_of_one_draw(chunk):
    """Chunked host draws (an output off the CPU) give one draw's numbers and leave the
    generator where one draw does, for lengths around the chunk boundaries."""
    for n in sorted({0, 1, 7, 15, 16, 17, chunk - 1, chunk, chunk + 1, chunk + 15, chunk + 16,
                     2 * chunk + 3, 3 * chunk + 31}):
        one = torch.Generator(device="cpu").manual_seed(5)
        expected = torch.randn(n, generator=one)
        chunked = torch.Generator(device="cpu").manual_seed(5)
        out = torch.empty(n)
        _draw_into(out, chunked, chunk)
        assert torch.equal(out, expected), n
        assert torch.equal(torch.randn(20, generator=chunked), torch.randn(20, generator=one))


def test_cotangents_are_the_same_numbers_on_every_device(monkeypatch):
    """An output elsewhere (a meta stand-in for CUDA) gets the CPU output's cotangents, drawn in
    chunks; with the default device elsewhere they are still made where the output is."""
    import fxopt.core.step as step

    monkeypatch.setattr(step, "COTANGENT_CHUNK", 32)
    shapes = [(3, 50), (), (7,), (2, 16)]
    cpu = cotangents_for([torch.empty(s) for s in shapes])
    with FakeTensorMode():
        fakes = cotangents_for([torch.empty(s, device=ELSEWHERE, dtype=torch.bfloat16)
                                for s in shapes])
    assert [(str(f.device), f.dtype, f.shape) for f in fakes] == [
        (ELSEWHERE, torch.bfloat16, c.shape) for c in cpu]
    with default_device_elsewhere():
        again = cotangents_for([torch.empty(s, device="cpu") for s in shapes], COTANGENT_SEED)
    assert all(torch.equal(a, c) for a, c in zip(again, cpu))


# -- opaque leaves follow a move (D5-D7)


class Router(nn.Module):
    """Reads values (``nonzero``): kept as an opaque leaf, run for real, replayed on fakes,
    and mixes the recorded answer with its parameters' results (a CPU answer would not mix
    with another device's tensors)."""

    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        picked = torch.nonzero(x[..., 0] > 0)
        return self.proj(x)[..., :2] + picked.float().mean(0)


class Routed(nn.Module):
    def __init__(self):
        super().__init__()
        self.inp = nn.Linear(8, 8)
        self.router = Router()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.router(torch.relu(self.inp(x))).sum(-1)


@pytest.mark.parametrize("replays", [True, False], ids=["replay", "stand-in"])
def test_opaque_leaves_replay_where_the_module_is(replays):
    """A leaf recorded on the CPU, replayed (or stood in for) on fakes of another device: its
    recorded answers and outputs are made there, and the peak and saved bytes of a stand-in on
    its outputs' device."""
    from fxopt.analysis.leaf_runs import measure_leaves
    from fxopt.graph.leaf_tape import leaf_records, leaves_replayed

    torch.manual_seed(0)
    model = Routed()
    x = torch.randn(4, 6, 8)
    with default_device_elsewhere():
        gm = fxopt.trace(model, (x,), leaf_modules=("router",))
        measure_leaves(gm, (x,))  # the figures a stand-in allocates
    records = leaf_records(gm)
    assert records[0].memory.peak_bytes > 0
    assert [r.path for r in records] == ["router"] and records[0].calls[0].home == "cpu"
    records[0].replays = replays
    made: list[str] = []
    real_empty = torch.empty

    def empty(*args, **kwargs):
        out = real_empty(*args, **kwargs)
        if out.dtype == torch.uint8:  # the stand-in's bytes (not the fake kernels' own work)
            made.append(str(out.device))
        return out

    with leaves_replayed(gm), default_device_elsewhere():
        torch.empty = empty  # what the stand-in allocates for the leaf's peak and saves
        try:
            outputs = _fake_forward(gm, (x,), ELSEWHERE, training=True)
        finally:
            torch.empty = real_empty
    assert {str(t.device) for t in outputs} == {ELSEWHERE}
    assert set(made) == (set() if replays else {ELSEWHERE})


# -- on a GPU (skipped without one): what the CPU lanes above stand in for


def _cuda_count() -> int:
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


@pytest.mark.cuda
@pytest.mark.skipif(_cuda_count() < 1, reason="needs a CUDA device")
def test_cuda_llama_at_min_optimizes_exports_and_loads_on_the_cpu(tmp_path):
    """The H200 crash (D1) and D4: optimize an export-captured LM on the GPU at "min", export
    it, load it on the CPU (no factory op names cuda)."""
    model, args, kwargs = hf_case("hf_llama_lm")
    model = model.cuda()
    kwargs = {k: v.cuda() for k, v in kwargs.items()}
    gm = fxopt.optimize(model, args, example_kwargs=kwargs, memory_budget="min")
    assert "causal_attention" in {p.name for p in gm.fxopt_report.passes if p.modified}
    assert baked_devices(gm, "cuda:0") == []
    bound = check_inputs(model, args, kwargs)
    export(gm, tmp_path / "llama", example_inputs=bound)
    loaded = load_exported(tmp_path / "llama").load(map_location="cpu")
    cpu_args = tuple(a.cpu() if isinstance(a, torch.Tensor) else a for a in bound)
    with torch.no_grad():
        loaded.eval()(*cpu_args)


@pytest.mark.cuda
@pytest.mark.skipif(_cuda_count() < 2, reason="needs two CUDA devices")
def test_cuda_a_module_moved_to_another_gpu_trains_there():
    """D3: captured on cuda:0, deep-copied and moved to cuda:1 (as per-rank copies are), the
    optimized module runs a training step on cuda:1, with the same loss as on cuda:0."""
    import copy

    model, args, kwargs = hf_case("hf_llama_lm")
    model = model.to("cuda:0")
    kwargs = {k: v.to("cuda:0") for k, v in kwargs.items()}
    gm = fxopt.optimize(model, args, example_kwargs=kwargs, memory_budget="min")
    moved = copy.deepcopy(gm).to("cuda:1")
    out0 = gm(**kwargs)
    out1 = moved(**{k: v.to("cuda:1") for k, v in kwargs.items()})
    out1.loss.backward()
    assert out1.loss.device == torch.device("cuda:1")
    torch.testing.assert_close(out1.loss.cpu(), out0.loss.detach().cpu())


def test_the_sliced_fused_step_and_the_fast_comparison_with_the_default_device_elsewhere():
    """Two paths that run on a GPU as they run here, in bfloat16: the fused AdamW step of a
    parameter in slices (from the first step, where the slices' state is gathered) and
    verification's float32 fast check, passing and failing."""
    model = seeded(WideMLP, 96).to(torch.bfloat16)
    x = torch.randn(3, 96, dtype=torch.bfloat16)
    ref = {"w": torch.linspace(1, 2, 4096).to(torch.bfloat16)}
    close = {"w": (ref["w"].float() * (1 + 1e-3)).to(torch.bfloat16)}
    far = {"w": close["w"].clone().index_fill_(0, torch.tensor([7]), 9.0)}
    with default_device_elsewhere():
        report = verify_fused_training(model, torch.optim.AdamW, x, steps=2, strict=True,
                                       step_slice_bytes=4096 * 2, lr=1e-2)
        assert report.ok and report.bit_identical, str(report)
        found: list = []
        assert compare_named("param_grad", ref, close, DEFAULT_TOLERANCES, found) == 1
        assert not found
        compare_named("param_grad", ref, far, DEFAULT_TOLERANCES, found)
        assert len(found) == 1 and found[0].detail.startswith("1 of 4096 elements outside")
