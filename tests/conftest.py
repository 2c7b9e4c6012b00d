"""pytest configuration: hypothesis profiles, chosen with FXOPT_HYPOTHESIS_PROFILE, the order in
which files reach pytest-xdist's workers (longest first), and a check that no test leaves global
torch state behind for the tests after it.

- ``ci`` (default): reproducible (``derandomize=True``), no deadline (optimize() traces, plans
  and verifies: seconds, not milliseconds), sized to keep tests/test_fuzz.py within its 90 s.
- ``long``: random seeds and many more examples; run by ``benchmarks/fuzz_long.py``.
- ``dev``: a handful of examples, for quick iterations on a property.
"""

import gc
import json
import os
from pathlib import Path

import pytest
import torch

from hypothesis import HealthCheck, settings

from fxopt.cli import collect_garbage_less_often

_SLOW_IS_FINE = [HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.filter_too_much]

settings.register_profile("ci", derandomize=True, deadline=None, max_examples=60,
                          suppress_health_check=_SLOW_IS_FINE, print_blob=True)
settings.register_profile("long", derandomize=False, deadline=None, max_examples=2000,
                          suppress_health_check=_SLOW_IS_FINE, print_blob=True)
settings.register_profile("dev", derandomize=False, deadline=None, max_examples=10,
                          suppress_health_check=_SLOW_IS_FINE, print_blob=True)
settings.load_profile(os.environ.get("FXOPT_HYPOTHESIS_PROFILE", "ci"))


def _share_the_cores_between_workers() -> None:
    """Under pytest-xdist, each worker gets its share of the cores for torch's intra-op threads
    (and so do the processes a test starts: OMP_NUM_THREADS). Otherwise every worker starts one
    thread per core, and on CI's two cores two workers' threads wait on each other: six heavy
    files took 4-8% longer that way (alternated runs, two cores, 2026-11-27)."""
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "0"))
    if workers > 1:
        threads = max(1, (os.cpu_count() or 1) // workers)
        torch.set_num_threads(threads)
        os.environ["OMP_NUM_THREADS"] = str(threads)


_share_the_cores_between_workers()


# With Python's defaults, full collections (0.3-0.5 s each in a worker that holds torch,
# transformers and sympy) were 13% of two heavy files' run (test_captured and
# test_submodule_changes: 7.5 s of 55 s in one process), 2.7 s with these thresholds and the freeze
# below. With both, and the files handed out longest first, the suite ran in 441 s instead of
# 733 s on two cores (2026-12-04). A test that needs a cycle gone calls gc.collect(), as under
# any thresholds. The processes tests spawn (the distributed tests' ranks,
# test_plan_determinism's) call it too. A prediction that changed with the collector's timing
# showed fxopt holding tensors in a reference cycle:
# tests/test_boxed.py::test_a_regions_first_call_without_grad_leaves_no_cycle_holding_tensors
collect_garbage_less_often()


def pytest_collection_finish(session):
    """What the imports and the test modules made stays for the whole run: moved out of the
    collector's sight (``gc.freeze``), full collections scan only what the tests make."""
    gc.collect()
    gc.freeze()


FILE_SECONDS = Path(__file__).parent / "data" / "file_seconds.json"


def pytest_configure(config):
    """``--dist loadfile`` hands out files in collection order (``--no-loadscope-reorder``)
    rather than by their number of tests, which says little of their time: see
    ``pytest_collection_modifyitems``."""
    if getattr(config.option, "dist", "no") == "loadfile":
        config.option.loadscopereorder = False


def pytest_collection_modifyitems(items):
    """Files longest first (``tests/data/file_seconds.json``, written by
    ``benchmarks/suite_durations.py``; a file it does not list counts as short), each file's
    tests in their own order. A worker that takes the next file when it is free then ends on
    short ones, and CI's two workers finish together instead of one running the last long
    file alone."""
    seconds = json.loads(FILE_SECONDS.read_text()) if FILE_SECONDS.exists() else {}
    position = {id(item): index for index, item in enumerate(items)}
    items.sort(key=lambda item: (-seconds.get(item.path.name, 0.0), position[id(item)]))


@pytest.fixture(autouse=True)
def no_global_torch_state_left_behind():
    """A test that leaves a torch-function mode active (``torch.set_default_device("cpu")`` does)
    or grad mode off changes every later test: fast paths turn off, each op pays a Python
    detour. fxopt must not leave one either; this fails the test that did."""
    grad = torch.is_grad_enabled()
    yield
    assert not torch.overrides.has_torch_function((torch.empty(0),)), \
        "a torch-function mode is still active after the test (set_default_device?)"
    assert torch.get_default_device() == torch.device("cpu"), torch.get_default_device()
    assert torch.is_grad_enabled() == grad, "grad mode changed by the test"
