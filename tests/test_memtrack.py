"""fxopt.analysis.memtrack: the live-storage tracker behind measured CPU peaks and predicted ones."""

import contextlib

import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from fxopt.analysis.memtrack import LiveStorageTracker


def test_peak_is_exact_with_lazy_collection_of_frees():
    tracker = LiveStorageTracker()
    with tracker:
        a = torch.empty(1000)            # 4000 bytes
        b = torch.empty(500)             # 2000, peak 6000
        del a
        c = torch.empty(1200)            # 4800: a's free is collected, 6800 is the new peak
        del b, c
        d = torch.empty(100)             # the bound (after uncollected frees) stays under the peak
    assert tracker.peak_bytes == 6800
    assert tracker.current_bytes == 400  # exact after exit
    assert d.numel() == 100


def test_timeline_entries_are_exact_after_every_op():
    tracker = LiveStorageTracker(record_timeline=True)
    with tracker:
        a = torch.ones(100)
        b = a + 1
        del a
        c = b * 2
    assert [bytes_ for _, bytes_ in tracker.timeline] == [400, 800, 800]
    assert c.numel() == 100


def test_cuda_storages_count_as_512_byte_allocator_blocks_even_as_fakes():
    tracker = LiveStorageTracker()
    with FakeTensorMode(), tracker:   # no GPU needed: fake CUDA tensors have CUDA storages
        a = torch.empty(15, device="cuda")        # 60 bytes -> one 512-byte block
        b = torch.empty(300, device="cuda")       # 1200 bytes -> 1536
        c = torch.empty(0, device="cuda")         # nothing allocated
    assert tracker.peak_bytes == 512 + 1536
    assert (a.device.type, b.device.type, c.numel()) == ("cuda", "cuda", 0)


def test_a_dispatch_mode_turns_autograds_in_place_gradient_sums_into_copies():
    """Where a tensor's gradient sums two contributions (a tied embedding, a residual branch),
    autograd adds the later one into the earlier in place when it holds the last reference, but
    not while any Python dispatch mode is active: there it allocates the sum. The tracker, and
    every fake-run estimate (run under dispatch modes), therefore count one tensor of that size
    more than a plain run holds (docs/limits.md). If torch changes this, this test says so."""
    contributions = []

    class Head(torch.autograd.Function):
        @staticmethod
        def forward(ctx, h, w):
            ctx.shape = h.shape
            return (h @ w.t()).sum()

        @staticmethod
        def backward(ctx, grad):
            made = torch.ones(64, 32) * grad
            contributions.append(made.data_ptr())
            return torch.ones(ctx.shape) * grad, made

    def step(mode):
        w = torch.randn(64, 32, requires_grad=True)
        with mode:
            h = torch.nn.functional.embedding(torch.tensor([1, 5]), w)
            Head.apply(h, w).backward()
        return w.grad.data_ptr() == contributions[-1]  # the head's tensor now holds the sum

    assert step(contextlib.nullcontext())
    assert not step(LiveStorageTracker())
