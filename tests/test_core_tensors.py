"""fxopt.core.tensors: bytes of values, storage identity, devices; and the helpers built on it."""

import pytest
import torch
from torch import fx, nn
from torch._subclasses.fake_tensor import FakeTensorMode

from fxopt.graph.fake_run import fake_copy
from fxopt.graph.meta import propagate_meta
from fxopt.core.tensors import (
    allocated_bytes,
    device_of,
    graph_device,
    module_device,
    storage_bytes,
    storage_key,
    tensor_bytes,
    tensors_in,
)
from fxopt.measure.allocations import cuda_peak_during


def test_views_of_one_storage_count_once_and_a_slice_counts_its_whole_base():
    base = torch.zeros(10, 10)                      # 400 bytes
    other = torch.zeros(5)                          # 20 bytes
    value = {"a": base, "b": (base.view(100), base.t()), "c": [other, base[0]], "d": 3}
    assert storage_bytes(value) == 420
    assert storage_bytes(base[2:3]) == 400
    assert tensor_bytes(value) == 400 * 3 + 20 + 40
    assert storage_bytes(None) == tensor_bytes("no tensor") == allocated_bytes([]) == 0


def test_distinct_storages_of_one_value_all_count():
    parts = tuple(torch.zeros(n) for n in (1, 2, 3, 4))
    assert storage_bytes(parts) == 40


def test_storage_key_is_shared_by_views_and_in_place_results_not_by_clones():
    x = torch.randn(4, 4)
    assert storage_key(x) == storage_key(x.view(16)) == storage_key(x[1]) == storage_key(x.add_(1))
    assert storage_key(x) != storage_key(x.clone())
    assert storage_key(x) != storage_key(x.contiguous().t().contiguous())
    with FakeTensorMode():
        f = torch.empty(3, 5)
        assert storage_key(f) == storage_key(f.transpose(0, 1)) != storage_key(f.clone())


def test_allocated_bytes_rounds_cuda_storages_to_512_byte_blocks_once_each():
    cpu = torch.zeros(15)
    assert allocated_bytes(cpu) == storage_bytes(cpu) == 60
    with FakeTensorMode():                       # fake CUDA tensors need no GPU
        a = torch.empty(15, device="cuda")       # 60 bytes -> 512
        b = torch.empty(300, device="cuda")      # 1200 bytes -> 1536
        empty = torch.empty(0, device="cuda")
    assert allocated_bytes(a) == 512
    assert allocated_bytes((a, a.view(3, 5), b, empty, cpu)) == 512 + 1536 + 60
    assert storage_bytes((a, b)) == 1260


def test_device_of_prefers_cuda_then_the_first_tensor():
    with FakeTensorMode():
        cuda = torch.empty(2, device="cuda")
    assert device_of((torch.zeros(1), {"x": cuda})) == cuda.device
    assert device_of([torch.empty(1, device="meta"), torch.zeros(1)]) == torch.device("meta")
    assert device_of(("no", "tensors")) == torch.device("cpu")


def test_module_device_looks_at_parameters_buffers_and_nested_inputs():
    assert module_device(nn.Linear(2, 2)) == torch.device("cpu")
    assert module_device(nn.Linear(2, 2, device="meta")) == torch.device("meta")
    with FakeTensorMode():
        cuda = torch.empty(2, device="cuda")
    assert module_device(nn.ReLU(), ({"x": [cuda]},)) == cuda.device
    assert module_device(nn.ReLU()) == torch.device("cpu")


def test_graph_device_reads_state_and_meta_values():
    gm = fx.symbolic_trace(nn.Sequential(nn.ReLU(), nn.Tanh()))
    assert graph_device(gm) == torch.device("cpu")          # no state, no meta yet
    with FakeTensorMode():
        cuda_input = torch.empty(2, 3, device="cuda")
    propagate_meta(gm, (cuda_input,))
    assert graph_device(gm).type == "cuda"
    propagate_meta(gm, (torch.zeros(2, 3),))
    assert graph_device(gm) == torch.device("cpu")
    linear = fx.symbolic_trace(nn.Linear(3, 3, device="meta"))
    assert graph_device(linear) == torch.device("meta")


def test_tensors_in_walks_pytrees_in_order():
    a, b = torch.zeros(1), torch.ones(1)
    found = tensors_in([a, {"k": (1, b)}, None])
    assert len(found) == 2 and found[0] is a and found[1] is b
    assert tensors_in(7) == []


def test_fake_copy_memoizes_real_tensors_and_rebuilds_fakes_of_other_modes():
    mode = FakeTensorMode(allow_non_fake_inputs=True)
    real = torch.randn(4, 6, requires_grad=True)
    fake = fake_copy(real, mode)
    assert fake_copy(real, mode) is fake
    assert storage_key(fake_copy(real.detach()[1], mode)) == storage_key(fake)
    strided = fake_copy(torch.randn(6, 4).t(), mode)
    again = fake_copy(strided, FakeTensorMode())
    assert (again.shape, again.stride(), again.dtype) == ((4, 6), (1, 4), torch.float32)
    assert fake.requires_grad and fake_copy(fake, FakeTensorMode()).requires_grad
    assert storage_key(again) != storage_key(strided)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_peak_during_is_the_allocator_peak_above_the_start():
    device = torch.device("cuda")
    held = torch.empty(1024, device=device)

    def run() -> None:
        a = torch.empty(1000, device=device)     # 4000 bytes -> 4096 in 512-byte blocks
        del a
        torch.empty(10, device=device)           # 512, after the free

    assert cuda_peak_during(run, device) == 4096
    assert held.numel() == 1024
