"""Models called and returning the way Hugging Face-style models are: keyword inputs, output
classes that are OrderedDicts and dataclasses at once, modules built inside forward, a cache in
the output. Each is a minimal model of our own; tests/test_ecosystem.py runs the real libraries.
"""

from __future__ import annotations

import collections
import dataclasses
import functools

import pytest
import torch
from torch import nn
from torch.utils import _pytree as pytree  # how diffusers registers its outputs

import fxopt
from fxopt.core.trees import map_tensors, named_leaves, sketch

X = torch.randn(3, 8)
MASK = torch.tensor([[1.0] * 8, [1.0] * 4 + [0.0] * 4, [0.0] * 8])


@dataclasses.dataclass
class Output(collections.OrderedDict):
    """Like transformers' ModelOutput: an OrderedDict of the fields that are not None, and a
    dataclass (``out.logits``)."""

    loss: torch.Tensor | None = None
    logits: torch.Tensor | None = None

    def __post_init__(self):
        for f in dataclasses.fields(self):
            if getattr(self, f.name) is not None:
                self[f.name] = getattr(self, f.name)


class Tagged(collections.OrderedDict):
    """A plain OrderedDict subclass."""


@dataclasses.dataclass
class Registered:
    """A dataclass registered as a pytree node without a key function, as diffusers does."""

    sample: torch.Tensor


pytree.register_pytree_node(Registered, lambda r: ([r.sample], None),
                            lambda children, _: Registered(children[0]))


def keywords_only(forward):
    """A ``*args, **kwargs`` decorator that keeps forward's signature, as transformers' do."""

    @functools.wraps(forward)
    def wrapper(self, *args, **kwargs):
        return forward(self, *args, **kwargs)

    return wrapper


class Classifier(nn.Module):
    """forward(x, bias=None, mask=None, labels=None) returning an ``Output``; nn.ReLU() is
    built inside forward, as DistilBERT's classifier head does."""

    def __init__(self, decorated: bool = False):
        super().__init__()
        self.proj = nn.Linear(8, 8)
        self.head = nn.Linear(8, 4)
        self.decorated = decorated

    def body(self, x, bias=None, mask=None, labels=None):
        h = self.proj(x)
        if bias is not None:
            h = h + bias
        if mask is not None:
            h = h * mask
        logits = self.head(nn.ReLU()(h))
        loss = None if labels is None else nn.functional.cross_entropy(logits, labels)
        return Output(loss=loss, logits=logits)

    def forward(self, x, bias=None, mask=None, labels=None):
        return self.body(x, bias, mask, labels)


class Decorated(Classifier):
    @keywords_only
    def forward(self, x, bias=None, mask=None, labels=None):
        return self.body(x, bias, mask, labels)


LABELS = torch.tensor([0, 3, 1])


@pytest.mark.parametrize("cls, frontend", [(Classifier, "fx"), (Decorated, "export")])
def test_keyword_inputs_optimize_verify_and_call_by_keyword(cls, frontend):
    model = cls()
    kwargs = {"x": X, "mask": MASK, "labels": LABELS}
    gm = fxopt.optimize(model, (), example_kwargs=kwargs, capture=frontend)
    assert gm.fxopt_report.verification.ok
    assert gm.fxopt_report.verification.checked["param_grad"] == 4
    expected = model(**kwargs)
    for out in (gm(**kwargs), gm(X, None, MASK, LABELS)):
        assert type(out) is Output
        assert list(out) == ["loss", "logits"]
        torch.testing.assert_close(out.loss, expected.loss, rtol=0, atol=0)
        torch.testing.assert_close(out.logits, expected.logits, rtol=0, atol=0)


def test_keyword_inputs_skip_to_a_later_parameter_and_keep_its_place():
    model = Decorated()
    gm = fxopt.optimize(model, (X,), example_kwargs={"labels": LABELS}, capture="export")
    out = gm(X, labels=LABELS)  # bias and mask were skipped: they default
    torch.testing.assert_close(out.loss, model(X, labels=LABELS).loss, rtol=0, atol=0)
    with pytest.raises(fxopt.InputError):
        gm(X, mask=MASK, labels=LABELS)  # captured with mask=None, so a mask is refused


@pytest.mark.parametrize("kwargs, fragments", [
    ({"x": X, "scale": 2.0}, ["'scale'", "**kwargs"]),
    ({"mask": MASK}, ["'x'", "example_kwargs"]),
])
def test_keyword_inputs_fxopt_cannot_bind_are_input_errors(kwargs, fragments):
    class Open(nn.Module):
        def __init__(self):
            super().__init__()
            self.proj = nn.Linear(8, 8)

        def forward(self, x, mask=None, **options):
            return self.proj(x) * (1 if mask is None else mask)

    with pytest.raises(fxopt.InputError) as info:
        fxopt.optimize(Open(), (), example_kwargs=kwargs)
    for fragment in fragments:
        assert fragment in str(info.value)
    assert info.value.hint


def test_an_input_given_both_ways_is_refused():
    with pytest.raises(fxopt.InputError, match="both positionally and by keyword"):
        fxopt.optimize(Classifier(), (X,), example_kwargs={"x": X})


@pytest.mark.parametrize("capture", ["fx", "export"])
@pytest.mark.parametrize("make", [
    lambda y, z: Output(loss=y.sum(), logits=z),
    lambda y, z: Tagged(first=y, second=z),
    lambda y, z: Registered(y + z),
    lambda y, z: (Tagged(first=y), [Output(logits=z)]),
], ids=["model_output", "ordered_dict_subclass", "pytree_without_keys", "nested"])
def test_output_classes_come_back_as_the_model_returns_them(capture, make):
    class Returns(nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b = nn.Linear(8, 8), nn.Linear(8, 8)

        def forward(self, x):
            return make(torch.tanh(self.a(x)), self.b(x))

    model = Returns()
    gm = fxopt.optimize(model, X, capture=capture)
    report = gm.fxopt_report.verification
    assert report.ok and report.checked["param_grad"] == 4, report
    out, expected = gm(X), model(X)
    assert sketch(out) == sketch(expected)
    for (name, got), (_, want) in zip(named_leaves(out), named_leaves(expected)):
        torch.testing.assert_close(got, want, rtol=0, atol=0, msg=name)


def test_verify_sees_a_wrong_container_class():
    class Plain(nn.Module):
        def __init__(self):
            super().__init__()
            self.a = nn.Linear(8, 8)

        def forward(self, x):
            return Tagged(first=self.a(x))

    class Lossy(Plain):
        def forward(self, x):
            return collections.OrderedDict(first=self.a(x))

    model = Plain()
    other = Lossy()
    other.load_state_dict(model.state_dict())
    report = fxopt.verify(model, other, X)
    assert not report.ok
    assert "containers differ: Tagged(*) vs OrderedDict(*)" in report.mismatches[0].detail


def test_a_module_built_inside_forward_is_traced_through_not_a_leaf():
    gm = fxopt.optimize(Classifier(), X, capture="fx")
    assert gm.fxopt_report.trace.leaves == []
    assert any(n.target in (torch.relu, nn.functional.relu) for n in gm.graph.nodes)


def test_a_cache_in_the_output_names_use_cache_false():
    class KVCache:
        def __init__(self, keys):
            self.keys = keys

    class CausalLM(nn.Module):
        def __init__(self):
            super().__init__()
            self.proj = nn.Linear(8, 8)

        @keywords_only
        def forward(self, x, use_cache=True):
            h = self.proj(x)
            return (h, KVCache([h])) if use_cache else (h,)

    with pytest.raises(fxopt.TraceError) as info:
        fxopt.optimize(CausalLM(), (), example_kwargs={"x": X}, capture="export")
    assert "output[1] is a KVCache" in str(info.value)
    assert "use_cache=False" in info.value.hint
    gm = fxopt.optimize(CausalLM(), (), example_kwargs={"x": X, "use_cache": False})
    assert gm.fxopt_report.verification.ok


def test_map_tensors_rebuilds_every_container_class():
    value = (Tagged(a=X), [Output(logits=X)], Registered(X), {"k": (X, 3)})
    doubled = map_tensors(lambda t: t * 2, value)
    assert sketch(doubled) == sketch(value)
    assert [n for n, _ in named_leaves(doubled)] == [n for n, _ in named_leaves(value)]
    assert named_leaves(doubled)[0] == ("[0]['a']", named_leaves(doubled)[0][1])
    torch.testing.assert_close(doubled[2].sample, X * 2)
