"""The direction of dependencies, read from every module's imports (ast, nothing is imported).

    ftsup.supervisor ──> shared core <── ftsup.trainer        ftsup.tools ──> anything
                         (ftsup.store, ftsup.protocol, ftsup.procs, ftsup.guard, ...: every module under ftsup/
                          but ftsup.tools)

- The shared core imports neither side, and only the standard library besides itself (the
  process modules also psutil, the durable tier's S3 backend boto3);
  `ftsup.guard` imports nothing of ftsup at all, because its exec
  wrapper runs isolated (`python -I -S`), where nothing else of ftsup can be found.
- `ftsup.trainer` never imports `ftsup.supervisor`, not even inside a function.
- `ftsup.supervisor` never imports `ftsup.trainer` at module level. Inside a function it may only
  where `LAZY_TRAINER_IMPORTS` says why: the commands that need torch import it when they run.
- Tooling (`ftsup.tools`) is imported by no product module: the CLI names its modules in one table and imports
  the one a command asks for (tests/unit/test_product_imports.py checks that at run time).
- Inside the supervisor, folders are layers (`SUPERVISOR_LAYERS`, lowest first): a module imports only from its
  own folder and the folders below it. The durable uploads are imported by the run loop only.
- Inside the trainer, the engine (`trainer.checkpoint`) imports of the trainer only `trainer.runtime` (the rank's
  environment); nothing imports the examples but the examples and tooling.
- No import circle in ftsup, and no module imports another module's `_private` name.

An import is an `import` statement, a `from ... import`, or `importlib.import_module` of a literal
name; one inside a function (or a lambda) is lazy, anything else runs at import time. For circles, `from pkg
import mod` depends on the module `pkg.mod` only, as import-linter reads it. One under
`if TYPE_CHECKING:` never runs: it is read for nothing here but the private names.
"""

from __future__ import annotations

import ast
import functools
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
FOLDERS = {"ftsup": "ftsup", "ftsup.supervisor": "supervisor", "ftsup.trainer": "trainer"}  # as setup.py maps them
# What a core module may import beyond the standard library: the process modules psutil; the durable tier's S3
# backend boto3 and its HTTP (botocore), which only an s3:// tier imports (the `durable` extra; ftsup/store/DESIGN.md,
# "Durable tier").
CORE_THIRD_PARTY = {
    "ftsup.procs": {"psutil"},
    "ftsup.store.durable.s3": {"boto3", "botocore"},
    "ftsup.store.durable.s3http": {"botocore"},
}

LAZY_TRAINER_IMPORTS = {
    "ftsup.supervisor.cli.commands": "the ckpt export and import commands need torch: imported when they run",
}
# The supervisor's folders, lowest first; the modules at its root (errors, the state directory's files) lie below all.
SUPERVISOR_LAYERS = ("config", "policy", "state", "telemetry", "eviction", "durable", "run", "cli")
# The C extension's module is its wrapper's (`ftsup.store.blocksum`) to import.
PRIVATE_MODULES = {"ftsup.store._blocksum": "ftsup.store.blocksum"}


@dataclass(frozen=True)
class Import:
    module: str  # the importing module
    target: str  # the imported module (for `from a import b`: `a.b`, which may also be a name in `a`)
    lazy: bool  # inside a function
    line: int
    typing_only: bool = False  # under `if TYPE_CHECKING:`

    def __str__(self) -> str:
        return f"{self.module}:{self.line} imports {self.target}{' (in a function)' if self.lazy else ''}"


def module_name(path: Path) -> str:
    for package, folder in sorted(FOLDERS.items(), key=lambda kv: -len(kv[0])):
        root = REPO / folder
        if path.is_relative_to(root):
            parts = [*package.split("."), *path.relative_to(root).with_suffix("").parts]
            return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
    raise ValueError(path)


def product_modules() -> Iterator[tuple[str, Path]]:
    seen = set()
    for folder in FOLDERS.values():
        for path in sorted((REPO / folder).rglob("*.py")):
            if path not in seen:
                seen.add(path)
                yield module_name(path), path


def imports_of(module: str, path: Path) -> list[Import]:
    tree = ast.parse(path.read_text(), str(path))
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found: list[Import] = []

    def visit(node: ast.AST, lazy: bool, typing_only: bool = False) -> None:
        line = getattr(node, "lineno", 0)
        if isinstance(node, ast.Import):
            found.extend(Import(module, a.name, lazy, line, typing_only) for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: resolved against this module's package
                up = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*up, *([base] if base else [])])
            found.append(Import(module, base, lazy, line, typing_only))
            found.extend(
                Import(module, f"{base}.{a.name}", lazy, line, typing_only) for a in node.names if a.name != "*"
            )
        elif (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Attribute | ast.Name)
            and (node.func.attr if isinstance(node.func, ast.Attribute) else node.func.id) == "import_module"
            and node.args
            and isinstance(node.args[0], ast.Constant)
            and isinstance(node.args[0].value, str)
        ):
            found.append(Import(module, node.args[0].value, lazy, line))
        inner = lazy or isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.Lambda)
        checked = node.body if isinstance(node, ast.If) and ast.unparse(node.test).endswith("TYPE_CHECKING") else []
        for child in ast.iter_child_nodes(node):
            visit(child, inner, typing_only or child in checked)

    visit(tree, False)
    return found


def under(name: str, package: str) -> bool:
    return name == package or name.startswith(package + ".")


def is_core(module: str) -> bool:
    """Every module under ftsup/ but the namespace root (whose lazy re-exports are names, not imports) and tooling."""
    sides = ("ftsup.supervisor", "ftsup.trainer", "ftsup.tools")
    return under(module, "ftsup") and module != "ftsup" and not any(under(module, side) for side in sides)


MODULES = dict(product_modules())


@functools.cache
def every_import() -> tuple[Import, ...]:
    """Every import of every product module, read once, when a test first asks (not while the suite collects)."""
    return tuple(imp for module, path in MODULES.items() for imp in imports_of(module, path))


def all_imports() -> list[Import]:
    """The imports that run: all but those under `if TYPE_CHECKING:`."""
    return [imp for imp in every_import() if not imp.typing_only]


def resolved(target: str) -> str | None:
    """The module an import's target is (for `from a import b`, `a.b` when that is a module, else `a`)."""
    while target and target not in MODULES:
        target = target.rpartition(".")[0]
    return target or None


def supervisor_layer(module: str) -> int:
    """The layer of a supervisor module: -1 at the root, else its folder's place in SUPERVISOR_LAYERS."""
    parts = module.split(".")
    if len(parts) > 3 or (len(parts) == 3 and (REPO / "supervisor" / parts[2]).is_dir()):
        return SUPERVISOR_LAYERS.index(parts[2])
    return -1


def test_the_shared_core_imports_only_itself_and_the_standard_library():
    bad = []
    for imp in all_imports():
        if not is_core(imp.module):
            continue
        top = imp.target.split(".")[0]
        if top == "ftsup":
            ok = (imp.target == "ftsup" or is_core(imp.target)) and imp.module != "ftsup.guard"
        else:
            ok = top in sys.stdlib_module_names or top in CORE_THIRD_PARTY.get(imp.module, set())
        if not ok:
            bad.append(str(imp))
    assert bad == []


def test_the_trainer_never_imports_the_supervisor():
    bad = [str(i) for i in all_imports() if under(i.module, "ftsup.trainer") and under(i.target, "ftsup.supervisor")]
    assert bad == []


def test_the_supervisor_imports_the_trainer_only_lazily_and_only_where_documented():
    bad = [
        str(i)
        for i in all_imports()
        if under(i.module, "ftsup.supervisor")
        and under(i.target, "ftsup.trainer")
        and not (i.lazy and i.module in LAZY_TRAINER_IMPORTS)
    ]
    assert bad == []


def test_no_product_module_imports_tooling():
    bad = [str(i) for i in all_imports() if not under(i.module, "ftsup.tools") and under(i.target, "ftsup.tools")]
    assert bad == []


def test_every_supervisor_folder_is_a_layer_the_test_knows():
    folders = {p.name for p in (REPO / "supervisor").iterdir() if (p / "__init__.py").is_file()}
    assert folders == set(SUPERVISOR_LAYERS)


def test_the_supervisor_imports_only_its_own_folder_and_the_folders_below_it():
    bad = []
    for imp in all_imports():
        target = resolved(imp.target)
        if not (under(imp.module, "ftsup.supervisor") and target and under(target, "ftsup.supervisor")):
            continue
        if target == "ftsup.supervisor":
            continue
        if imp.module == "ftsup.supervisor.cli" or supervisor_layer(target) <= supervisor_layer(imp.module):
            continue
        bad.append(str(imp))
    assert bad == []


def test_the_durable_uploads_are_imported_by_the_run_loop_only():
    bad = [
        str(i)
        for i in all_imports()
        if under(i.target, "ftsup.supervisor.durable")
        and not any(under(i.module, m) for m in ("ftsup.supervisor.durable", "ftsup.supervisor.run", "ftsup.tools"))
    ]
    assert bad == []


def test_the_engine_imports_of_the_trainer_only_the_runtime_and_nothing_imports_the_examples():
    bad = [
        str(i)
        for i in all_imports()
        if (
            under(i.module, "ftsup.trainer.checkpoint")
            and under(i.target, "ftsup.trainer")
            and not any(under(i.target, m) for m in ("ftsup.trainer.checkpoint", "ftsup.trainer.runtime"))
            and i.target != "ftsup.trainer"
        )
        or (
            under(i.target, "ftsup.trainer.examples")
            and not any(under(i.module, m) for m in ("ftsup.trainer.examples", "ftsup.tools"))
        )
    ]
    assert bad == []


def circles(imports: list[Import]) -> list[list[str]]:
    """The import circles among `imports` (strongly connected groups of modules), each sorted."""
    graph: dict[str, set[str]] = {m: set() for m in MODULES}
    statements: dict[tuple[str, int], set[str]] = {}
    for imp in imports:
        statements.setdefault((imp.module, imp.line), set()).add(imp.target)
    for imp in imports:
        # `from pkg import mod` depends on `pkg.mod`, not on `pkg` (as import-linter reads it): else every package
        # whose __init__ names one of its modules would make a circle with each module of it.
        named = statements[(imp.module, imp.line)]
        if any(t.startswith(f"{imp.target}.") and t in MODULES for t in named):
            continue
        target = resolved(imp.target)
        if target is not None and target != imp.module:
            graph[imp.module].add(target)
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(v: str) -> None:  # Tarjan's algorithm
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            group = []
            while (w := stack.pop()) != v:
                group.append(w)
            if group:
                found.append(sorted([v, *group]))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_no_module_of_ftsup_is_part_of_an_import_circle():
    assert circles(all_imports()) == []


def test_the_circle_finder_finds_a_circle_through_a_lazy_import():
    a, b = sorted(MODULES)[:2]
    assert circles([Import(a, b, False, 1), Import(b, a, True, 1)]) == [sorted([a, b])]


def private_uses(module: str, path: Path) -> list[str]:
    """Where `module` uses another ftsup module's `_private` name: imported by name, or as an attribute of a module
    it imported (`from pkg import mod` or `import pkg.mod as mod`, then `mod._name`)."""
    tree = ast.parse(path.read_text(), str(path))
    found = []
    aliases: dict[str, str] = {}
    for imp in imports_of(module, path):
        name = imp.target.rpartition(".")[2]
        if name.startswith("_") and not name.startswith("__") and under(imp.target, "ftsup"):
            if PRIVATE_MODULES.get(imp.target) == module:
                continue
            if resolved(imp.target) != module:
                found.append(f"{module}:{imp.line} imports {imp.target}")
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            for a in node.names:
                if f"{node.module}.{a.name}" in MODULES:
                    aliases[a.asname or a.name] = f"{node.module}.{a.name}"
        elif isinstance(node, ast.Import):
            aliases.update({a.asname: a.name for a in node.names if a.asname and a.name in MODULES})
    for node in ast.walk(tree):
        if (
            isinstance(node, ast.Attribute)
            and isinstance(node.value, ast.Name)
            and node.value.id in aliases
            and node.attr.startswith("_")
            and not node.attr.startswith("__")
        ):
            found.append(f"{module}:{node.lineno} uses {aliases[node.value.id]}.{node.attr}")
    return found


def test_no_module_uses_another_modules_private_names():
    assert [use for module, path in MODULES.items() for use in private_uses(module, path)] == []


def test_a_private_name_reached_through_a_module_alias_is_found(tmp_path: Path):
    source = tmp_path / "probe.py"
    source.write_text("from ftsup.store import layout\nlayout._secret()\n")
    assert private_uses("ftsup.supervisor.probe", source) == [
        "ftsup.supervisor.probe:2 uses ftsup.store.layout._secret"
    ]


def test_the_reader_of_imports_sees_lazy_relative_and_dynamic_ones(tmp_path: Path):
    source = tmp_path / "probe.py"
    source.write_text(
        "import os\n"
        "from . import sibling\n"
        "def f():\n"
        "    from ftsup.trainer import state\n"
        "    return importlib.import_module('ftsup.tools.bench.checkpoint')\n"
    )
    got = {(i.target, i.lazy) for i in imports_of("ftsup.supervisor.probe", source)}
    at_import = {"os", "ftsup.supervisor", "ftsup.supervisor.sibling"}
    in_function = {"ftsup.trainer", "ftsup.trainer.state", "ftsup.tools.bench.checkpoint"}
    assert got == {(t, False) for t in at_import} | {(t, True) for t in in_function}


def test_an_import_under_type_checking_is_read_as_typing_only(tmp_path: Path):
    source = tmp_path / "probe.py"
    source.write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from ftsup.store import layout\n")
    got = {(i.target, i.typing_only) for i in imports_of("ftsup.supervisor.probe", source) if "store" in i.target}
    assert got == {("ftsup.store", True), ("ftsup.store.layout", True)}
