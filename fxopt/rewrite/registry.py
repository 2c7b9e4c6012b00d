"""An explicit, ordered registry of passes: what the pipeline may run, and in which order.

Passes run in the registry's order whatever order a user lists them in; a list out of order is a
``ConfigError`` naming the order (silently reordering would hide, e.g., that checkpointing
decisions were taken on an unpadded graph). The built-in registry is ``passes.REGISTRY``;
``fxopt.optimize(..., registry=...)`` takes another, e.g. ``passes.REGISTRY.with_pass(spec)``
to add a pass of one's own. A registry is never changed in place, so one caller's additions
cannot leak into another's pipeline.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass

from fxopt.core.errors import ConfigError
from fxopt.rewrite.pass_base import PassResult


BUDGET_ROLES = (None, "keeps", "joins")


@dataclass(frozen=True)
class PassSpec:
    """A pass as the pipeline knows it: its canonical name, the function, a one-line summary
    (CLI help), whether the default pipeline runs it, and accepted short aliases; and what it
    needs from the pipeline, declared here so the pipeline never names a pass:

    - ``budget``: the pass's part in a memory budget (``fxopt.optimize(memory_budget=...)``):
      ``"keeps"`` (it is what meets the budget: a budget brings it into any pass list, and
      without such a pass a budget is an error), ``"joins"`` (it helps: a budget brings it into
      the default pipeline), or None. Either way the budget is given to the pass as its
      ``budget`` option, unless the pass list sets that option itself.
    - ``reads_training``: the pass plans for the training step and takes the pipeline's
      ``fxopt.TrainingSetup`` as its ``training`` option.
    - ``always``: every pipeline runs it, named in a pass list or not (a structural step the
      optimized module's contract depends on, such as keeping the model's blocks as calls).
    """

    name: str
    run: Callable[..., PassResult]
    summary: str
    default: bool = True
    aliases: tuple[str, ...] = ()
    budget: str | None = None
    reads_training: bool = False
    always: bool = False

    def __post_init__(self) -> None:
        if self.budget not in BUDGET_ROLES:
            raise ConfigError(f"pass {self.name!r}: budget={self.budget!r} is not one of "
                              f"{BUDGET_ROLES}", hint="'keeps': the pass meets a memory budget; "
                              "'joins': it helps the default pipeline meet one")


class PassRegistry:
    """Passes in canonical order (the order they were given in)."""

    def __init__(self, specs: Iterable[PassSpec] = ()):
        self._specs: dict[str, PassSpec] = {}
        for spec in specs:
            taken = {spec.name, *spec.aliases} & self._names()
            if taken:
                raise ConfigError(f"pass {spec.name!r}: name or alias {sorted(taken)} is taken",
                                  hint="give the pass a name and aliases of its own")
            self._specs[spec.name] = spec

    def _names(self) -> set[str]:
        return {n for s in self._specs.values() for n in (s.name, *s.aliases)}

    def with_pass(self, spec: PassSpec, *, before: str | None = None) -> PassRegistry:
        """A new registry with ``spec`` added at the end (before the structural passes every
        pipeline ends with, ``PassSpec.always``), or just before the pass ``before``."""
        specs = list(self._specs.values())
        if before is not None:
            index = self.canonical_order().index(before)
        else:
            index = len(specs)
            while index and specs[index - 1].always and not spec.always:
                index -= 1
        return PassRegistry([*specs[:index], spec, *specs[index:]])

    def canonical_order(self) -> list[str]:
        return list(self._specs)

    def lookup(self, name: str) -> PassSpec | None:
        """The pass called ``name`` or aliased so, or None."""
        for spec in self._specs.values():
            if name == spec.name or name in spec.aliases:
                return spec
        return None

    def defaults(self) -> list[PassSpec]:
        return [s for s in self._specs.values() if s.default or s.always]

    def __iter__(self) -> Iterator[PassSpec]:
        return iter(list(self._specs.values()))

    def __len__(self) -> int:
        return len(self._specs)

    def __repr__(self) -> str:
        return f"PassRegistry({', '.join(self._specs)})"
