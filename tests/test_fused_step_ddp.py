"""The fused optimizer step under DistributedDataParallel trains exactly like plain DDP.

Two CPU processes (``torch.multiprocessing.spawn``, gloo, a ``file://`` rendezvous in tmp_path)
train the same model for ``STEPS`` steps on their own data, each rank seeing other batches, so
a step on local gradients would differ from one on averaged gradients:

- the reference: DDP and the ordinary optimizer (``zero_grad``, backward, ``step``);
- DDP and ``fxopt.fuse_optimizer(ddp, ...)``: each bucket is stepped after its all-reduce;
  with SGD momentum and AdamW, with ``gradient_as_bucket_view`` off and on, on the user's model
  and on fxopt's checkpointed GraphModule of it;
- gradient accumulation by ``ddp.no_sync()`` over two micro-batches, both ways.

Parameters, buffers and optimizer state equal the reference's on every rank after the steps.
The refusals that need a process group are checked in the same processes: fusing a module that
is not the DDP wrapper, ``accumulation_steps`` under DDP, ``find_unused_parameters=True``.
"""

from __future__ import annotations

import contextlib
import datetime
import gc

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

import fxopt
from fxopt.core.errors import ConfigError, InputError
from fxopt.runtime.fuse import fuse_optimizer
from fxopt.cli import collect_garbage_less_often
from helpers import exit_passed_worker

STEPS = 3
WORLD = 2
OPTIMIZERS = {
    "sgd_momentum": (torch.optim.SGD, {"lr": 0.1, "momentum": 0.9}),
    "adamw": (torch.optim.AdamW, {"lr": 1e-2, "weight_decay": 0.1}),
}


class SmallNet(nn.Module):
    def __init__(self):
        super().__init__()
        layers: list[nn.Module] = [nn.Conv2d(3, 8, 3, padding=1)]
        for _ in range(3):
            layers += [nn.BatchNorm2d(8), nn.ReLU(), nn.Conv2d(8, 8, 3, padding=1)]
        self.features = nn.Sequential(*layers)
        self.head = nn.Linear(8, 4)

    def forward(self, x):
        return self.head(self.features(x).mean((2, 3)))


def make_model() -> SmallNet:
    with torch.random.fork_rng():
        torch.manual_seed(0)
        return SmallNet()


def batch(rank: int, step: int) -> torch.Tensor:
    return torch.randn(4, 3, 12, 12, generator=torch.Generator().manual_seed(100 * rank + step))


def train(model: nn.Module, rank: int, optimizer: str, *, fused: bool, micro_batches: int = 1,
          bucket_view: bool = False) -> dict[str, torch.Tensor]:
    # A small bucket cap: several buckets per backward, so steps interleave with all-reduces.
    ddp = DDP(model, bucket_cap_mb=0.001, gradient_as_bucket_view=bucket_view)
    cls, kwargs = OPTIMIZERS[optimizer]
    opt = fuse_optimizer(ddp, cls, **kwargs) if fused else cls(ddp.parameters(), **kwargs)
    for step in range(STEPS):
        for micro in range(micro_batches):
            last = micro == micro_batches - 1
            with contextlib.nullcontext() if last else ddp.no_sync():
                ddp(batch(rank, 10 * step + micro)).square().mean().backward()
        opt.step()
        opt.zero_grad()
    state = {f"model.{k}": v.detach().clone() for k, v in model.state_dict().items()}
    for index, entries in opt.state_dict()["state"].items():
        state.update({f"optimizer.{index}.{key}": torch.as_tensor(value).clone()
                      for key, value in entries.items()})
    if fused:
        opt.remove()
    del ddp, opt  # release the reducer's gloo work before the process group goes
    gc.collect()
    return state


def _check_refusals(rank: int) -> None:
    with pytest.raises(InputError, match="not a DistributedDataParallel") as info:
        fuse_optimizer(make_model(), torch.optim.SGD, lr=0.1)
    assert "fuse the DDP wrapper" in info.value.hint
    fused = fuse_optimizer(make_model(), torch.optim.SGD, lr=0.1, local_gradients=True)
    fused.remove()
    with pytest.raises(ConfigError, match="no_sync") as info:
        fuse_optimizer(DDP(make_model()), torch.optim.SGD, lr=0.1, accumulation_steps=2)
    assert "ddp.no_sync()" in info.value.hint
    with pytest.raises(InputError, match="find_unused_parameters") as info:
        fuse_optimizer(DDP(make_model(), find_unused_parameters=True), torch.optim.SGD, lr=0.1)
    assert "find_unused_parameters=False" in info.value.hint
    hooked = DDP(make_model())
    hooked.register_comm_hook(None, lambda state, bucket: None)
    with pytest.raises(InputError, match="already has a communication hook"):
        fuse_optimizer(hooked, torch.optim.SGD, lr=0.1)


def _worker(rank: int, init_file: str) -> None:
    torch.set_num_threads(1)
    collect_garbage_less_often()
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank,
                            world_size=WORLD, timeout=datetime.timedelta(seconds=120))
    try:
        _check_refusals(rank)
        optimized = fxopt.optimize(make_model(), batch(0, 0), memory_budget="min", verify=False)
        assert any(r.name == "checkpoint" and r.modified for r in optimized.fxopt_report.passes)
        cases = [(optimizer, {}) for optimizer in OPTIMIZERS]
        cases += [("adamw", {"bucket_view": True}), ("sgd_momentum", {"micro_batches": 2}),
                  ("adamw", {"optimized": True})]
        for optimizer, options in cases:
            options = dict(options)
            model = optimized if options.pop("optimized", False) else None
            reference = train(make_model(), rank, optimizer, fused=False, **options)
            trained = train(model or make_model(), rank, optimizer, fused=True, **options)
            if model is not None:  # the GraphModule's names: compare values in order
                trained = dict(zip(reference, trained.values()))
            assert list(trained) == list(reference), (optimizer, options)
            for key, value in reference.items():
                torch.testing.assert_close(trained[key], value, rtol=0, atol=0,
                                           msg=f"{optimizer} {options}: {key} on rank {rank}")
        dist.barrier()  # neither rank tears gloo down while the other still talks to it
    finally:
        dist.destroy_process_group()
    exit_passed_worker()


def test_fused_step_under_ddp_trains_like_plain_ddp(tmp_path):
    mp.spawn(_worker, args=(str(tmp_path / "rendezvous"),), nprocs=WORLD, join=True)
