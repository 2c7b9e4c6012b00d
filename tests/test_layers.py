"""The architecture as a test: which package may import which.

Layers, lowest first (docs/how-it-works.md, "Where things live"). A module may import its own layer and any
lower one, never a higher one; ``fxopt/runtime`` imports torch and the standard library only,
because the exporter copies it next to generated code where fxopt is not installed.
"""

import ast
import graphlib
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
LAYERS = ["runtime", "core", "graph", "capture", "analysis", "planning", "rewrite", "passes",
          "verify", "measure", "export", "api", "bench", "cli", "package"]
API_MODULES = {"fxopt.api", "fxopt.check", "fxopt.testing", "fxopt.integrations"}


def module_name(path: Path) -> str:
    """The name a file imports as: ``passes/`` and ``models_zoo/`` lie beside ``fxopt/`` in the
    repository and are ``fxopt.passes`` / ``fxopt.models_zoo`` (pyproject's package-dir)."""
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    if parts[0] in ("passes", "models_zoo"):
        parts.insert(0, "fxopt")
    return ".".join(parts)


def layer_of(module: str) -> str | None:
    """The layer of an fxopt or passes module; None for anything else (torch, stdlib, ...)."""
    parts = module.split(".")
    if parts[0] == "passes":
        return "passes"
    if parts[0] != "fxopt" or parts[1:2] == ["models_zoo"]:  # the zoo: models, no layer
        return None
    if module in API_MODULES or any(module.startswith(m + ".") for m in API_MODULES):
        return "api"
    if len(parts) == 1:
        return "package"
    if parts[1] == "__main__":
        return "cli"
    return parts[1] if parts[1] in LAYERS else "package"


def imported_modules(source: str, importer: str) -> set[str]:
    """Every module an import statement anywhere in ``source`` names (function-local included);
    ``from fxopt.x import y`` counts as ``fxopt.x.y`` when that is a module, else ``fxopt.x``."""
    names = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                package = importer.split(".")[:-node.level] if node.level else []
                base = ".".join([*package, base] if base else package)
            names.add(base)
    return names


def layer_edges(files: dict[str, str]) -> dict[tuple[str, str], list[str]]:
    """(importing layer, imported layer) -> the modules that import across that edge."""
    edges: dict[tuple[str, str], list[str]] = {}
    for module, source in files.items():
        mine = layer_of(module)
        for imported in imported_modules(source, module):
            theirs = layer_of(imported)
            if mine and theirs and theirs != mine:
                edges.setdefault((mine, theirs), []).append(f"{module} imports {imported}")
    return edges


def upward_imports(edges: dict[tuple[str, str], list[str]]) -> list[str]:
    """Every import from a lower layer into a higher one, and any cycle between layers."""
    graph: dict[str, set[str]] = {}
    for (importer, imported) in edges:
        graph.setdefault(importer, set()).add(imported)
    problems = []
    try:
        list(graphlib.TopologicalSorter(graph).static_order())
    except graphlib.CycleError as error:
        problems.append(f"layers import each other: {' -> '.join(error.args[1])}")
    for (importer, imported), where in sorted(edges.items()):
        if LAYERS.index(imported) > LAYERS.index(importer):
            problems.append(f"{importer} (lower) imports {imported} (higher): {where[0]}")
    return problems


def project_files() -> dict[str, str]:
    paths = [*ROOT.glob("fxopt/**/*.py"), *ROOT.glob("passes/**/*.py")]
    return {module_name(p): p.read_text() for p in paths}


def test_every_module_belongs_to_a_layer():
    unplaced = [m for m in project_files() if layer_of(m) == "package" and m != "fxopt"]
    assert not unplaced, f"modules outside every layer: {unplaced}"


def test_layers_import_only_downwards():
    edges = layer_edges(project_files())
    assert edges, "found no imports between layers: the scan is broken"
    assert upward_imports(edges) == []


def test_the_derived_order_is_the_documented_one():
    """Sorting the layers by their imports gives an order the documented table agrees with."""
    edges = layer_edges(project_files())
    graph: dict[str, set[str]] = {layer: set() for layer in LAYERS}
    for importer, imported in edges:
        graph[importer].add(imported)
    derived = list(graphlib.TopologicalSorter(graph).static_order())
    position = {layer: i for i, layer in enumerate(derived)}
    for importer, imported in edges:
        assert position[imported] < position[importer]
    table = (ROOT / "docs" / "how-it-works.md").read_text()
    documented = [line.split("`")[1].rstrip("/").split("/")[-1] for line in table.splitlines()
                  if line.startswith("| `fxopt/") or line.startswith("| `passes/")]
    assert documented == [layer for layer in LAYERS if layer not in ("api", "package")], (
        "docs/how-it-works.md's table of packages lists the layers in another order")


def test_the_check_catches_a_planted_upward_import():
    files = project_files()
    files["fxopt.core.planted"] = "from fxopt.planning.solver import plan_checkpoints\n"
    files["fxopt.runtime.planted"] = "import passes\n"
    files["fxopt.capture.planted"] = "import fxopt.passes.checkpoint\n"
    files["fxopt.core.planted_hf"] = "from fxopt.integrations.hf_trainer import x\n"
    problems = upward_imports(layer_edges(files))
    assert any("core (lower) imports planning (higher)" in p for p in problems)
    assert any("runtime (lower) imports passes (higher)" in p for p in problems)
    assert any("capture (lower) imports passes (higher)" in p for p in problems)
    assert any("core (lower) imports api (higher)" in p for p in problems)
    files["fxopt.planning.ok"] = "from ..core import errors\n"
    assert layer_edges({"fxopt.planning.ok": files["fxopt.planning.ok"]}) == {
        ("planning", "core"): ["fxopt.planning.ok imports fxopt.core"]}


RUNTIME = sorted((ROOT / "fxopt" / "runtime").glob("*.py"))


def runtime_imports_beyond_torch(source: str) -> list[str]:
    """What a runtime module imports besides torch, the standard library and its siblings
    imported relatively (``from .errors import InputError``: the exporter copies siblings
    together, and the copies import each other relatively; ``from fxopt.runtime.errors`` would
    need fxopt installed)."""
    allowed = set(sys.stdlib_module_names) | {"torch", "__future__"}
    siblings = {p.stem for p in RUNTIME}
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.ImportFrom) and node.level:
            if node.level != 1 or node.module not in siblings:
                found.append(f"{'.' * node.level}{node.module or ''}")
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            names = ([a.name for a in node.names] if isinstance(node, ast.Import)
                     else [node.module or ""])
            found += [name for name in names if name.split(".")[0] not in allowed]
    return found


@pytest.mark.parametrize("path", RUNTIME, ids=[p.name for p in RUNTIME])
def test_runtime_imports_torch_and_the_standard_library_only(path):
    assert runtime_imports_beyond_torch(path.read_text()) == []


def test_the_runtime_check_catches_an_absolute_or_foreign_import():
    assert runtime_imports_beyond_torch("from .errors import InputError\nimport torch.nn\n") == []
    assert runtime_imports_beyond_torch(
        "from fxopt.runtime.errors import InputError\nfrom ..core import errors\n"
        "from .nowhere import x\nimport numpy\n") == ["fxopt.runtime.errors", "..core",
                                                       ".nowhere", "numpy"]


def test_the_runtime_owns_the_errors_and_core_re_exports_them():
    """What an optimized module runs raises fxopt's own errors without being handed the class
    (no ``error=`` argument), and every layer's import names the same classes."""
    import inspect

    from fxopt.core import errors as core_errors
    from fxopt.runtime import errors as runtime_errors
    from fxopt.runtime.fused_step import FusedOptimizer
    from fxopt.runtime.input_guard import InputGuard

    assert core_errors.__all__ and all(getattr(core_errors, name) is getattr(runtime_errors, name)
                                       for name in core_errors.__all__)
    assert issubclass(runtime_errors.InputError, runtime_errors.FxoptError)
    for cls in (FusedOptimizer, InputGuard):
        assert "error" not in inspect.signature(cls).parameters


def meta_key_literals(source: str, keys: set[str]) -> list[str]:
    """Lines where ``source`` spells a meta key as a string instead of its constant."""
    return [f"line {node.lineno}: {node.value!r}" for node in ast.walk(ast.parse(source))
            if isinstance(node, ast.Constant) and node.value in keys]


def test_meta_keys_are_spelled_only_in_core_meta_keys():
    """``node.meta`` / ``gm.meta`` keys are contracts between layers: declared (name, what the
    value holds) in ``fxopt.core.meta_keys`` and used through its constants everywhere else."""
    from fxopt.core import meta_keys

    keys = {value for name, value in vars(meta_keys).items()
            if name.isupper() and isinstance(value, str) and name != "REAL"}
    assert {"fxopt_trace", "fxopt_export", "fxopt_saved", "fxopt_meta_source", "fxopt_pass",
            "nn_module_stack"} <= keys
    found = {module: lines for module, source in project_files().items()
             if module != "fxopt.core.meta_keys"
             and (lines := meta_key_literals(source, keys))}
    assert found == {}
    assert meta_key_literals('node.meta["fxopt_pass"] = "x"\n"""a ``fxopt_pass`` doc"""\n',
                             keys) == ["line 1: 'fxopt_pass'"]


# What capture and the analyses write into ``meta`` and a pass may read; a pass writes only its
# provenance (``PASS``, through ``fxopt.rewrite.pass_base.mark_new``).
META_A_PASS_MAY_READ = {"NN_MODULE_STACK", "SAVED", "META_SOURCE", "LEAF", "TRACE", "EXPORT"}


def test_no_pass_reads_what_another_pass_leaves_in_meta():
    """Decisions travel between passes through the graph itself (a call's arguments), never
    through a meta key one pass writes and another reads (issue 34: the chunked loss's chunk
    size went through one)."""
    from fxopt.core import meta_keys

    constants = {name for name, value in vars(meta_keys).items()
                 if name.isupper() and isinstance(value, str)}
    used = {}
    for path in sorted((ROOT / "passes").glob("*.py")):
        tree = ast.parse(path.read_text())
        names = {node.attr for node in ast.walk(tree) if isinstance(node, ast.Attribute)
                 and isinstance(node.value, ast.Name) and node.value.id == "meta_keys"
                 and node.attr in constants}
        names |= {alias.name for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)
                  and node.module == "fxopt.core.meta_keys" for alias in node.names}
        if names - META_A_PASS_MAY_READ:
            used[path.name] = sorted(names - META_A_PASS_MAY_READ)
    assert used == {}
