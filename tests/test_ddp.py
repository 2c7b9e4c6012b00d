"""An optimized model trains under DistributedDataParallel exactly like the original.

Two CPU processes (``torch.multiprocessing.spawn``, gloo, a ``file://`` rendezvous in tmp_path)
each wrap the same models in DDP and train them for ``STEPS`` SGD steps on their own data:

- the unoptimized model (the reference),
- the model ``fxopt.optimize`` returned with a memory budget, so it holds checkpointed regions
  (DDP plus activation checkpointing is where "Expected to mark a variable ready only once"
  comes from: fxopt's regions are non-reentrant checkpoints, which DDP supports with
  ``find_unused_parameters=False``), once with ``static_graph=False`` and once with True,
- the module ``fxopt.export`` wrote and torch loaded back.

After the steps every parameter and buffer equals the reference's on every rank. Then, in the
same processes, ``checkpoint(profile=False)`` plans the same on both ranks although each measures
other device rates. The models are tiny and the step count small: the cost is two Python
processes importing torch, spawned once for both checks.
"""

from __future__ import annotations

import copy
import datetime
import gc

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

import fxopt
from fxopt.export.writer import export, load_exported
from fxopt.cli import collect_garbage_less_often
from helpers import exit_passed_worker

STEPS = 3
WORLD = 2
BUDGET = 0.75


class SmallNet(nn.Module):
    """Convs with BatchNorm and dropout: activation-heavy enough for the checkpoint pass."""

    def __init__(self):
        super().__init__()
        layers: list[nn.Module] = [nn.Conv2d(3, 8, 3, padding=1)]
        for _ in range(4):
            layers += [nn.BatchNorm2d(8), nn.ReLU(), nn.Conv2d(8, 8, 3, padding=1)]
        self.features = nn.Sequential(*layers)
        self.drop = nn.Dropout(0.2)
        self.head = nn.Linear(8, 4)

    def forward(self, x):
        return self.head(self.drop(self.features(x).mean((2, 3))))


def make_model() -> SmallNet:
    with torch.random.fork_rng():
        torch.manual_seed(0)
        return SmallNet()


def batch(rank: int, step: int) -> torch.Tensor:
    return torch.randn(4, 3, 16, 16, generator=torch.Generator().manual_seed(100 * rank + step))


def train(model: nn.Module, rank: int, static_graph: bool = False) -> dict[str, torch.Tensor]:
    ddp = DDP(model, find_unused_parameters=False, static_graph=static_graph)
    optimizer = torch.optim.SGD(ddp.parameters(), lr=0.1, momentum=0.9)
    for step in range(STEPS):
        torch.manual_seed(1000 * step + rank)  # the same dropout masks for every model
        loss = ddp(batch(rank, step)).square().mean()
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
    state = {k: v.detach().clone() for k, v in model.state_dict().items()}
    del ddp, optimizer  # release the reducer's gloo work before the process group goes
    gc.collect()
    return state


def _worker(rank: int, init_file: str, export_dir: str) -> None:
    torch.set_num_threads(1)
    collect_garbage_less_often()
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank,
                            world_size=WORLD, timeout=datetime.timedelta(seconds=120))
    try:
        optimized = fxopt.optimize(make_model(), batch(0, 0), memory_budget=BUDGET, verify=False)
        regions = [r for r in optimized.fxopt_report.passes if r.name == "checkpoint"]
        assert regions and regions[0].modified, "the budget should have checkpointed regions"
        static = copy.deepcopy(optimized)
        exported = load_exported(export_dir).load()
        reference = train(make_model(), rank)
        for name, trained in (("optimized", train(optimized, rank)),
                              ("optimized, static_graph", train(static, rank, static_graph=True)),
                              ("exported", train(exported, rank))):
            assert list(trained) == list(reference), name
            for key, value in reference.items():
                torch.testing.assert_close(trained[key], value, msg=f"{name}: {key} on rank {rank}")
        # and DDP kept the ranks in step: the same parameters everywhere (BatchNorm statistics
        # are each rank's own after the last step: DDP broadcasts buffers before a forward)
        parameters = dict(make_model().named_parameters())
        flat = torch.cat([v.flatten() for k, v in reference.items() if k in parameters])
        gathered = [torch.empty_like(flat) for _ in range(WORLD)]
        dist.all_gather(gathered, flat)
        torch.testing.assert_close(gathered[0], gathered[1])
        plans_the_same_on_every_rank(rank)
        dist.barrier()  # neither rank tears gloo down while the other still talks to it
    finally:
        dist.destroy_process_group()
    exit_passed_worker()


def plans_the_same_on_every_rank(rank: int) -> None:
    """Each rank measures other device rates (a busy machine, another core): ``profile=False``
    must cost nodes and plan regions the same everywhere, from FLOPs and bytes alone. Runs after
    the training checks, which plan with the measured rates: the fake rates replace them here
    (``node_costs`` looks ``device_rates`` up at each call, so the cached measurement is not
    used)."""
    import fxopt.analysis.costmodel as costmodel
    from fxopt.capture.trace import trace

    costmodel.device_rates = lambda device="cpu": (1e9 * (rank + 1) ** 3, 1e9 / (rank + 1) ** 3)
    model, x = make_model(), batch(0, 0)
    costs = costmodel.node_costs(trace(model, x), profile=False)
    gm = fxopt.optimize(model, x, verify=False, predict_memory=False,
                        passes=[("checkpoint", {"budget": BUDGET, "profile": False})])
    record = next(p for p in gm.fxopt_report.passes if p.name == "checkpoint")
    mine = {"seconds": [c.seconds for c in costs.values()], "code": gm.code,
            "regions": [r.as_dict() for r in record.stats.get("regions", [])]}
    everyone = [None] * WORLD
    dist.all_gather_object(everyone, mine)
    assert mine["regions"], "the budget should have checkpointed regions"
    assert all(theirs == mine for theirs in everyone), f"rank {rank} differs"


def test_optimized_and_exported_models_train_like_the_original_under_ddp_and_plan_alike(
        tmp_path):
    """The optimized and exported models train like the original under DDP; and
    ``checkpoint(profile=False)`` promises the same plan on every DDP rank: two processes whose
    measured device rates differ cost every node and plan every region alike (one spawn of the
    two ranks serves both checks)."""
    gm = fxopt.optimize(make_model(), batch(0, 0), memory_budget=BUDGET)  # verified here, once
    result = export(gm, tmp_path / "exported", example_inputs=batch(0, 0))
    assert result.regions > 0 and result.verification.ok
    mp.spawn(_worker, args=(str(tmp_path / "rendezvous"), str(tmp_path / "exported")),
             nprocs=WORLD, join=True)
