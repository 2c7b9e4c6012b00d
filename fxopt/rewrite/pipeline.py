"""Config, and the one loop that runs passes, lints after each, and records what each did.

``run_passes(gm, config, registry)`` runs the configured passes in the registry's canonical order. After every pass it
recompiles the module and lints the graph (``fxopt.rewrite.invariants``); a pass that crashes or leaves a bad
graph becomes a ``PassError`` naming that pass and the passes that ran before it. With
``config.dump_dir`` set, the graph is written out before the first pass and after each pass.
"""

from __future__ import annotations

import ast
import inspect
import re
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from torch import fx

from fxopt.core import progress
from fxopt.core.errors import BudgetError, ConfigError, FxoptError, PassError
from fxopt.core.modules import wrap_own_calls
from fxopt.rewrite.invariants import lint_after_pass, snapshot
from fxopt.rewrite.pass_base import plain_stats
from fxopt.rewrite.registry import PassRegistry, PassSpec
from fxopt.core.training_setup import TrainingSetup

PassRequest = str | tuple[str, dict[str, Any]]

_SPEC_ITEM = re.compile(r"\s*([A-Za-z_][\w-]*)\s*(?:\{([^}]*)\})?\s*(?:,|$)")


def _parse_value(text: str) -> Any:
    lowered = text.strip().lower()
    if lowered in ("true", "false"):
        return lowered == "true"
    try:
        return ast.literal_eval(text.strip())
    except (ValueError, SyntaxError):
        return text.strip()


def parse_pass_spec(spec: str) -> list[tuple[str, dict[str, Any]]]:
    """Parse ``"inplace,checkpoint{budget=0.5},reorder"`` into ``[(name, options), ...]``."""
    items: list[tuple[str, dict[str, Any]]] = []
    pos = 0
    spec = spec.strip()
    while pos < len(spec):
        match = _SPEC_ITEM.match(spec, pos)
        if not match or match.end() == pos:
            raise ConfigError(
                f"cannot parse pass list {spec!r} at character {pos}",
                hint="write passes as name or name{key=value,...}, separated by commas, "
                "e.g. inplace,checkpoint{budget=0.5}",
            )
        options = {}
        for pair in filter(None, (p.strip() for p in (match.group(2) or "").split(","))):
            key, sep, value = pair.partition("=")
            if not sep:
                raise ConfigError(f"pass option {pair!r} in {spec!r} has no '='",
                                  hint="write options as key=value")
            options[key.strip()] = _parse_value(value)
        items.append((match.group(1), options))
        pos = match.end()
    return items


@dataclass
class Config:
    """What to run. ``passes=None`` means the registry's default passes. A ``memory_budget``
    brings in the passes that declare a part in it (``PassSpec.budget``: the one that keeps it
    into any list, the ones that join it into the default pipeline) and is their ``budget``
    option. ``training`` describes the training step the passes plan for
    (``fxopt.TrainingSetup``), given to every pass that declares ``reads_training``."""

    passes: list[PassRequest] | str | None = None
    memory_budget: int | float | str | None = None
    dump_dir: str | Path | None = None
    training: TrainingSetup = field(default_factory=TrainingSetup)

    def given(self, spec: PassSpec) -> dict[str, Any]:
        """What the pipeline hands ``spec`` besides its options, as its spec declares."""
        return {"training": self.training} if spec.reads_training else {}

    def resolved(self, registry: PassRegistry) -> list[tuple[PassSpec, dict[str, Any]]]:
        """The passes of ``registry`` to run with their options, validated, in canonical order."""
        if self.passes is None:
            requests: list[tuple[str, dict[str, Any]]] = [(s.name, {}) for s in registry.defaults()]
        elif isinstance(self.passes, str):
            requests = parse_pass_spec(self.passes)
        else:
            requests = [(p, {}) if isinstance(p, str) else (p[0], dict(p[1])) for p in self.passes]
        order = registry.canonical_order()
        resolved = []
        for name, options in requests:
            spec = registry.lookup(name)
            if spec is None:
                raise ConfigError(
                    f"unknown pass {name!r}",
                    hint=f"known passes, in order: {', '.join(order) or '(none registered)'}",
                )
            resolved.append((spec, options))
        names = [spec.name for spec, _ in resolved]
        if len(set(names)) != len(names):
            raise ConfigError(f"pass list names a pass twice: {names}", hint="list each pass once")
        if names != sorted(names, key=order.index):
            raise ConfigError(
                f"passes {names} are out of order",
                hint=f"list them in the canonical order: {', '.join(order)}",
            )
        _bring_in(resolved, registry, [spec for spec in registry if spec.always])
        if self.memory_budget is not None:
            _bring_in_for_budget(resolved, registry, default_pipeline=self.passes is None)
            for spec, options in resolved:
                if spec.budget is not None:
                    options.setdefault("budget", self.memory_budget)
        return resolved


def _bring_in_for_budget(resolved: list[tuple[PassSpec, dict[str, Any]]],
                         registry: PassRegistry, *, default_pipeline: bool) -> None:
    """Add the passes a memory budget brings in (``PassSpec.budget``) to ``resolved``, in
    canonical order: those that keep it always, those that join it in the default pipeline."""
    keepers = [spec for spec in registry if spec.budget == "keeps"]
    if not keepers:
        raise ConfigError(
            "memory_budget was given but no pass of the registry keeps a budget",
            hint="drop memory_budget, or use fxopt's own registry (passes.REGISTRY)")
    wanted = keepers + ([spec for spec in registry if spec.budget == "joins"]
                        if default_pipeline else [])
    _bring_in(resolved, registry, wanted)


def _bring_in(resolved: list[tuple[PassSpec, dict[str, Any]]], registry: PassRegistry,
              wanted: list[PassSpec]) -> None:
    """Add each of ``wanted`` not in ``resolved`` yet, keeping the canonical order."""
    present = {spec.name for spec, _ in resolved}
    resolved.extend((spec, {}) for spec in wanted if spec.name not in present)
    order = registry.canonical_order()
    resolved.sort(key=lambda item: order.index(item[0].name))


@dataclass
class PassRecord:
    """What one pass did: exact ``modified``, its stats, node counts and time taken."""

    name: str
    options: dict[str, Any]
    modified: bool
    stats: dict[str, Any] = field(default_factory=dict)
    seconds: float = 0.0
    nodes_before: int = 0
    nodes_after: int = 0

    def as_dict(self) -> dict[str, Any]:
        return {
            "name": self.name, "options": {k: repr(v) for k, v in self.options.items()},
            "modified": self.modified, "stats": plain_stats(self.stats), "seconds": self.seconds,
            "nodes_before": self.nodes_before, "nodes_after": self.nodes_after,
        }


def _dump(gm: fx.GraphModule, dump_dir: Path, index: int, label: str) -> None:
    dump_dir.mkdir(parents=True, exist_ok=True)
    (dump_dir / f"{index:02d}_{label}.txt").write_text(
        gm.print_readable(print_output=False) + "\n\n" + str(gm.graph)
    )


def _check_options(spec: PassSpec, options: dict[str, Any], where: str) -> None:
    """Options the pass does not take are the user's mistake (a TypeError raised *inside* a pass
    is the pass's bug, reported as a PassError like any other crash)."""
    try:
        inspect.signature(spec.run).bind(None, **options)
    except TypeError as error:
        raise ConfigError(f"bad options {options} for pass {spec.name!r}: {error}",
                          where=where, hint=f"see help(passes.{spec.name})") from error


def run_passes(gm: fx.GraphModule, config: Config, registry: PassRegistry) -> list[PassRecord]:
    """Run ``config``'s passes from ``registry`` on ``gm`` in place; one record per pass."""
    plan = config.resolved(registry)
    dump_dir = Path(config.dump_dir) if config.dump_dir else None
    if dump_dir:
        _dump(gm, dump_dir, 0, "traced")
    records: list[PassRecord] = []
    for index, (spec, options) in enumerate(plan, start=1):
        done = [r.name for r in records]
        where = f"pass {spec.name!r} (after: {', '.join(done) or 'nothing'})"
        _check_options(spec, options, where)
        before = snapshot(gm)
        start = time.perf_counter()
        try:
            with progress.phase(spec.name):
                result = spec.run(gm, **{**config.given(spec), **options})
        except (BudgetError, ConfigError, PassError):
            raise
        except FxoptError as error:
            # e.g. an InputError from an analysis a pass ran: the user's inputs were checked
            # when tracing, so inside a pass it is the pass's failure, not the user's
            raise PassError(f"pass {spec.name!r} failed: {type(error).__name__}: {error.what}",
                            where=where + (f"; {error.where}" if error.where else ""),
                            hint=f"leave it out (passes=[...] without {spec.name!r}) and report "
                            "the bug with the traceback (CLI: --debug)") from error
        except Exception as error:
            raise PassError(
                f"pass {spec.name!r} crashed: {type(error).__name__}: {error}",
                where=where,
                hint=f"leave it out (passes=[...] without {spec.name!r}) and report the bug "
                "with the traceback (CLI: --debug)",
            ) from error
        seconds = time.perf_counter() - start
        if result.graph_module is not gm:
            raise PassError(f"pass {spec.name!r} returned a different GraphModule", where=where,
                            hint="passes must edit gm in place")
        wrap_own_calls(gm.graph)  # the calls a pass added stay calls when torch.load re-traces
        gm.recompile()
        lint_after_pass(gm, before, spec.name, result.modified, where)
        records.append(PassRecord(spec.name, options, result.modified, dict(result.stats),
                                  seconds, len(before.node_names), len(gm.graph.nodes)))
        if dump_dir:
            _dump(gm, dump_dir, index, spec.name)
    return records
