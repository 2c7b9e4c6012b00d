"""When channel padding pays: a quick verdict from device and dtype, then a verdict per padded op.

``padding_pays(gm)`` is the cheap first question ``passes.pad_channels`` asks before any analysis:
aligned channel counts speed up tensor-core kernels, so padding is on for CUDA float16/bfloat16
graphs, and for CUDA float32 graphs when TF32 tensor cores run some of their ops. Those are two
switches (``TensorCores``): cuDNN convolutions use TF32 when ``torch.backends.cudnn.allow_tf32``
is on (torch's default: True, so float32 convs run on tensor cores out of the box), cuBLAS matmuls
and linears when ``torch.backends.cuda.matmul.allow_tf32`` is on or
``torch.set_float32_matmul_precision`` is "high"/"medium" (default: off). Off on CPU and for
float32 with both off. It reads the device and dtype of parameters, buffers and inputs, so a
model that runs in float32 under ``torch.autocast`` looks like float32: pass ``force=True`` to pad
it anyway.

``Decider.keep(case)`` then decides per op. Unless forced, an op with no tensor-core kernel is
declined without timing (a float32 conv with cuDNN TF32 off, a float32 linear or matmul with
TF32 matmuls off). The rest, like Inductor's matmul padding: the op's forward and backward are
timed once unpadded and once padded (weight pads, and the input pad when its input arrives
unpadded, included), alternately, and the pad is kept only if it is faster by more than
``margin``. A Decider keeps its timings per (op, shapes, options, dtype, device) for its own life
(one pass run); on CUDA they are also kept in ``$FXOPT_CACHE_DIR/pad_timings.json`` (default
``~/.cache/fxopt``) keyed by GPU name, torch and cuDNN versions and the backend settings that
change which kernels run (``backend_settings()``: cuDNN enabled/benchmark/deterministic, TF32
for convolutions and matmuls, float32 matmul precision), so a timing taken under other settings
is never reused. A cache file that cannot be read or written is ignored.

Testable without a GPU: ``padding_pays``, ``default_decider`` and ``Decider`` take the backend
facts as a ``TensorCores`` (default: read from torch, ``TensorCores.current()``), the device and
dtypes come from the graph's fake values (a graph whose meta says CUDA needs no GPU), and the timer
is injectable (``Decider(timer=...)``).
"""

from __future__ import annotations

import json
import os
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import fx

from fxopt.core.tensors import graph_device

# The functional form every padded op is rewritten to, by name (also what the timer runs).
OPS: dict[str, Callable[..., torch.Tensor]] = {
    "conv1d": F.conv1d, "conv2d": F.conv2d, "conv3d": F.conv3d,
    "conv_transpose1d": F.conv_transpose1d, "conv_transpose2d": F.conv_transpose2d,
    "conv_transpose3d": F.conv_transpose3d, "linear": F.linear, "matmul": torch.matmul,
}
_HALF = (torch.float16, torch.bfloat16)


@dataclass(frozen=True)
class TimingCase:
    """One op, unpadded and padded: what the timer runs and the key of the timing cache.

    ``shapes``/``padded`` are the operand shapes (input, weight, bias; or a, b), None for an
    absent bias. ``copied[i]`` says the padded variant must make operand ``i`` by padding the
    original (weights always; an input that does not arrive padded already).
    """

    op: str
    shapes: tuple[tuple[int, ...] | None, ...]
    padded: tuple[tuple[int, ...] | None, ...]
    copied: tuple[bool, ...]
    options: tuple[Any, ...]
    padded_options: tuple[Any, ...]
    dtype: str
    device: str


Timer = Callable[[TimingCase], tuple[float, float]]  # -> (unpadded seconds, padded seconds)


_CONVS = frozenset({"conv1d", "conv2d", "conv3d", "conv_transpose1d", "conv_transpose2d",
                    "conv_transpose3d"})


def _precision(*levels: Any) -> str:
    """torch's newer TF32 switches (``fp32_precision``: "tf32", "ieee" or "none" = as the level
    above), most specific first."""
    for level in levels:
        value = getattr(level, "fp32_precision", "none") if level is not None else "none"
        if value != "none":
            return value
    return "ieee"


def _conv_tf32() -> bool:
    cudnn = torch.backends.cudnn
    try:
        return bool(cudnn.allow_tf32)
    except RuntimeError:  # torch refuses the legacy flag after a mix of old and new switches
        return _precision(getattr(cudnn, "conv", None), cudnn, torch.backends) == "tf32"


def _matmul_tf32() -> bool:
    try:
        return bool(torch.backends.cuda.matmul.allow_tf32) or \
            torch.get_float32_matmul_precision() != "highest"
    except RuntimeError:  # as in _conv_tf32
        return _precision(torch.backends.cuda.matmul, getattr(torch.backends, "cuda", None),
                          torch.backends) == "tf32"


@dataclass(frozen=True)
class TensorCores:
    """Which float32 ops run on TF32 tensor cores (half precision always does, on CUDA).

    ``conv_tf32``: cuDNN convolutions (``torch.backends.cudnn.enabled`` and its TF32 switch).
    ``matmul_tf32``: cuBLAS linears and matmuls (TF32 matmuls, or float32 matmul precision
    "high"/"medium"). Pass one to the policy to decide for a device without reading it.
    """

    conv_tf32: bool
    matmul_tf32: bool

    @classmethod
    def current(cls) -> TensorCores:
        """The switches as torch has them now."""
        return cls(conv_tf32=bool(torch.backends.cudnn.enabled) and _conv_tf32(),
                   matmul_tf32=_matmul_tf32())

    def run(self, op: str, dtype: str) -> bool:
        """Whether a CUDA ``op`` (a key of ``OPS``) in ``dtype`` ("torch.float16") runs on tensor
        cores, so that aligned channels can pay."""
        name = dtype.removeprefix("torch.")
        if name in ("float16", "bfloat16"):
            return True
        if name != "float32":
            return False
        return self.conv_tf32 if op in _CONVS else self.matmul_tf32

    def why_not(self, op: str, dtype: str) -> str:
        name = dtype.removeprefix("torch.")
        if name != "float32":
            return f"{name} runs no tensor-core kernels"
        if op in _CONVS:
            return "float32 conv with cuDNN TF32 off (torch.backends.cudnn.allow_tf32) " \
                   "runs no tensor-core kernels"
        return "float32 matmul with TF32 matmuls off (torch.backends.cuda.matmul.allow_tf32) " \
               "runs no tensor-core kernels"


def tf32_enabled(cores: TensorCores | None = None) -> bool:
    """Whether some float32 op (convs or matmuls) runs on TF32 tensor cores."""
    cores = TensorCores.current() if cores is None else cores
    return cores.conv_tf32 or cores.matmul_tf32


def graph_tensors(gm: fx.GraphModule) -> list[torch.Tensor]:
    """The floating-point parameters, buffers and inputs of ``gm`` (inputs from their meta)."""
    tensors = [*gm.parameters(), *gm.buffers()]
    tensors += [n.meta["val"] for n in gm.graph.nodes
                if n.op == "placeholder" and isinstance(n.meta.get("val"), torch.Tensor)]
    return [t for t in tensors if t.is_floating_point()]


def padding_pays(gm: fx.GraphModule, cores: TensorCores | None = None) -> tuple[bool, str]:
    """(whether to pad by default, why): decided from devices and dtypes only, in microseconds.

    ``cores``: the TF32 switches (default: ``TensorCores.current()``)."""
    tensors = graph_tensors(gm)
    cuda = [t for t in tensors if t.device.type == "cuda"]
    if not cuda:
        devices = sorted({t.device.type for t in tensors}) or ["cpu"]
        return False, (f"runs on {'/'.join(devices)}: aligned channels only pay on CUDA tensor "
                       "cores (pad_channels{force=true} pads anyway)")
    dtypes = {t.dtype for t in cuda}
    if dtypes & set(_HALF):
        names = "/".join(sorted(str(d).removeprefix("torch.") for d in dtypes & set(_HALF)))
        return True, f"CUDA {names}: tensor-core kernels want aligned channels"
    cores = TensorCores.current() if cores is None else cores
    if torch.float32 in dtypes and tf32_enabled(cores):
        which = " and ".join(name for name, on in (("cuDNN convs", cores.conv_tf32),
                                                    ("matmuls", cores.matmul_tf32)) if on)
        return True, f"CUDA float32 with TF32 {which}: tensor-core kernels want aligned channels"
    return False, ("CUDA float32 without TF32 (cuDNN or matmul) runs no tensor-core kernels "
                   "(pad_channels{force=true} pads anyway, e.g. for autocast)")


@dataclass
class Decider:
    """Keeps a pad when ``timer`` says the padded op is faster by more than ``margin``.

    ``cores``: when given, a CUDA op that runs no tensor-core kernel under these switches is
    declined first, untimed. Without a timer every other pad is kept (``force=True``, or
    measuring switched off).
    """

    timer: Timer | None = None
    margin: float = 0.03
    cache_file: Path | None = None
    timings: dict[TimingCase, tuple[float, float]] = field(default_factory=dict)
    cores: TensorCores | None = None

    def keep(self, case: TimingCase) -> bool | str:
        """True: pad it. False (measured slower) or a reason: leave it unpadded."""
        if self.cores is not None and case.device.startswith("cuda") and \
                not self.cores.run(case.op, case.dtype):
            return self.cores.why_not(case.op, case.dtype)
        if self.timer is None:
            return True
        original, padded = self.seconds(case)
        return padded < original * (1.0 - self.margin)

    def seconds(self, case: TimingCase) -> tuple[float, float]:
        if case not in self.timings:
            self.timings[case] = self._cached(case)
        return self.timings[case]

    def _cached(self, case: TimingCase) -> tuple[float, float]:
        stored = _read_cache(self.cache_file).get(_file_key(case)) if self.cache_file else None
        if isinstance(stored, list) and len(stored) == 2 and \
                all(isinstance(v, (int, float)) for v in stored):
            return float(stored[0]), float(stored[1])
        assert self.timer is not None
        seconds = self.timer(case)
        if self.cache_file is not None:
            _write_cache(self.cache_file, _file_key(case), seconds)
        return seconds


def backend_settings() -> tuple[tuple[str, Any], ...]:
    """The global switches that change which convolution and matmul kernels run."""
    cudnn = torch.backends.cudnn
    try:
        precision = torch.get_float32_matmul_precision()
    except RuntimeError:  # torch refuses it after a mix of old and new TF32 switches
        precision = _precision(torch.backends.cuda.matmul, torch.backends)
    return (("cudnn", cudnn.enabled), ("cudnn_benchmark", cudnn.benchmark),
            ("cudnn_deterministic", cudnn.deterministic), ("cudnn_tf32", _conv_tf32()),
            ("matmul_tf32", _matmul_tf32()), ("float32_matmul_precision", precision))


def default_decider(gm: fx.GraphModule, *, measure: bool | None, timer: Timer | None,
                    force: bool, cores: TensorCores | None = None) -> Decider:
    """The decider ``pad_channels`` uses: see the module docstring for when it measures.
    Unless ``force``, it declines CUDA ops without tensor-core kernels under ``cores`` (default:
    ``TensorCores.current()``)."""
    if force:
        cores = None
    elif cores is None:
        cores = TensorCores.current()
    if measure is False or (measure is None and timer is None and force):
        return Decider(cores=cores)
    if timer is not None:
        return Decider(timer, cores=cores)
    device = graph_device(gm)
    if measure is None and device.type != "cuda":
        return Decider(cores=cores)
    return Decider(time_case, cache_file=default_cache_file() if device.type == "cuda" else None,
                   cores=cores)


def default_cache_file() -> Path:
    return Path(os.environ.get("FXOPT_CACHE_DIR", "~/.cache/fxopt")).expanduser() / \
        "pad_timings.json"


def _file_key(case: TimingCase) -> str:
    device = torch.device(case.device)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else device.type
    settings = ",".join(f"{k}={v}" for k, v in backend_settings())
    return (f"{name}|torch {torch.__version__}|cudnn {torch.backends.cudnn.version()}|"
            f"{settings}|{case!r}")


def _read_cache(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def _write_cache(path: Path, key: str, value: tuple[float, float]) -> None:
    try:
        data = _read_cache(path)
        data[key] = list(value)
        path.parent.mkdir(parents=True, exist_ok=True)
        scratch = path.with_suffix(f".{os.getpid()}.tmp")
        scratch.write_text(json.dumps(data, indent=0, sort_keys=True))
        scratch.replace(path)
    except OSError:
        pass


def pad_list(rank_pads: dict[int, int]) -> list[int]:
    """``F.pad``'s list for zeros appended along negative dims: ``{-1: 3}`` -> ``[0, 3]``."""
    pads = [0] * (2 * max(-d for d in rank_pads))
    for dim, amount in rank_pads.items():
        pads[2 * (-dim - 1) + 1] = amount
    return pads


def time_case(case: TimingCase, *, repeats: int = 25, warmup: int = 3) -> tuple[float, float]:
    """Median seconds of forward+backward of ``case`` unpadded and padded, timed alternately
    (CUDA events on CUDA, wall clock elsewhere)."""
    device, dtype = torch.device(case.device), getattr(torch, case.dtype.removeprefix("torch."))
    generator = torch.Generator(device=device).manual_seed(0)  # the global RNG is left alone

    def random(shape: tuple[int, ...]) -> torch.Tensor:
        return torch.randn(shape, generator=generator, device=device, dtype=dtype)

    def tensor(shape: tuple[int, ...]) -> torch.Tensor:
        return random(shape).requires_grad_()

    fn = OPS[case.op]
    originals = [None if s is None else tensor(s) for s in case.shapes]
    padded_leaves = [None if s is None or copied else tensor(p)
                     for s, p, copied in zip(case.shapes, case.padded, case.copied)]

    def padded_operands() -> list[torch.Tensor | None]:
        out = []
        for original, leaf, shape, copied in zip(originals, padded_leaves, case.padded,
                                                 case.copied):
            if original is None or not copied:
                out.append(leaf)
            else:
                grow = {d - len(shape): p - o for d, (o, p) in
                        enumerate(zip(original.shape, shape)) if p != o}
                out.append(F.pad(original, pad_list(grow)) if grow else original)
        return out

    def step(operands: Callable[[], list], options: tuple, leaves: list) -> Callable[[], None]:
        grad: list[torch.Tensor] = []

        def run() -> None:
            out = fn(*operands(), *options)
            if not grad:
                grad.append(random(out.shape))
            torch.autograd.grad(out, [t for t in leaves if t is not None], grad[0])
        return run

    padded_inputs = [o if copied else leaf
                     for o, leaf, copied in zip(originals, padded_leaves, case.copied)]
    runs = (step(lambda: originals, case.options, originals),
            step(padded_operands, case.padded_options, padded_inputs))
    samples: tuple[list[float], list[float]] = ([], [])
    for index in range(warmup + repeats):
        for which in ((0, 1) if index % 2 == 0 else (1, 0)):
            seconds = _timed(runs[which], device)
            if index >= warmup:
                samples[which].append(seconds)
    return statistics.median(samples[0]), statistics.median(samples[1])


def _timed(run: Callable[[], None], device: torch.device) -> float:
    if device.type == "cuda":
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        run()
        end.record()
        end.synchronize()
        return start.elapsed_time(end) / 1e3
    begin = time.perf_counter()
    run()
    return time.perf_counter() - begin
