"""The direction of dependencies, read from every module's imports (ast, nothing is imported).

    ftsup.supervisor ──> shared core <── ftsup.trainer
                         (ftsup.store, ftsup.protocol, ftsup.procs, ftsup.guard: every module under ftsup/)

- The shared core imports neither side, and only the standard library besides itself (the
  process modules also psutil, the durable tier's S3 backend boto3);
  `ftsup.guard` imports nothing of ftsup at all, because its exec
  wrapper runs isolated (`python -I -S`), where nothing else of ftsup can be found.
- `ftsup.trainer` never imports `ftsup.supervisor`, not even inside a function.
- `ftsup.supervisor` never imports `ftsup.trainer` at module level. Inside a function it may only
  where `LAZY_TRAINER_IMPORTS` says why: the commands that need torch import it when they run.

An import is an `import` statement, a `from ... import`, or `importlib.import_module` of a literal
name; one inside a function (or a lambda) is lazy, anything else runs at import time.
"""

from __future__ import annotations

import ast
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
FOLDERS = {"ftsup": "ftsup", "ftsup.supervisor": "supervisor", "ftsup.trainer": "trainer"}  # as setup.py maps them
# What a core module may import beyond the standard library: the process modules psutil; the durable tier's S3
# backend boto3, which only an s3:// tier imports (the `durable` extra; ftsup/store/DESIGN.md, "Durable tier").
CORE_THIRD_PARTY = {"ftsup.procs": {"psutil"}, "ftsup.store.s3": {"boto3", "botocore"}}

LAZY_TRAINER_IMPORTS = {
    "ftsup.supervisor.cli": "`ftsup ckpt export-hf` and `ftsup bench checkpoint` need torch: imported when they run",
    "ftsup.supervisor.bench.scale_store": "`ftsup bench scale`'s store side: its clock, torch-free, is the trainer "
    "side's (`ftsup.trainer.bench.scale_measure`), imported when it runs",
}


@dataclass(frozen=True)
class Import:
    module: str  # the importing module
    target: str  # the imported module (for `from a import b`: `a.b`, which may also be a name in `a`)
    lazy: bool  # inside a function
    line: int

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

    def visit(node: ast.AST, lazy: bool) -> None:
        line = getattr(node, "lineno", 0)
        if isinstance(node, ast.Import):
            found.extend(Import(module, a.name, lazy, line) for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: resolved against this module's package
                up = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*up, *([base] if base else [])])
            found.append(Import(module, base, lazy, line))
            found.extend(Import(module, f"{base}.{a.name}", lazy, line) for a in node.names if a.name != "*")
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
        for child in ast.iter_child_nodes(node):
            visit(child, inner)

    visit(tree, False)
    return found


def under(name: str, package: str) -> bool:
    return name == package or name.startswith(package + ".")


def is_core(module: str) -> bool:
    """Every module under ftsup/ but the namespace root (whose lazy re-exports are names, not imports)."""
    sides = ("ftsup.supervisor", "ftsup.trainer")
    return under(module, "ftsup") and module != "ftsup" and not any(under(module, side) for side in sides)


ALL_IMPORTS = [imp for module, path in product_modules() for imp in imports_of(module, path)]


def test_the_shared_core_imports_only_itself_and_the_standard_library():
    bad = []
    for imp in ALL_IMPORTS:
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
    bad = [str(i) for i in ALL_IMPORTS if under(i.module, "ftsup.trainer") and under(i.target, "ftsup.supervisor")]
    assert bad == []


def test_the_supervisor_imports_the_trainer_only_lazily_and_only_where_documented():
    bad = [
        str(i)
        for i in ALL_IMPORTS
        if under(i.module, "ftsup.supervisor")
        and under(i.target, "ftsup.trainer")
        and not (i.lazy and i.module in LAZY_TRAINER_IMPORTS)
    ]
    assert bad == []


def test_the_reader_of_imports_sees_lazy_relative_and_dynamic_ones(tmp_path: Path):
    source = tmp_path / "probe.py"
    source.write_text(
        "import os\n"
        "from . import sibling\n"
        "def f():\n"
        "    from ftsup.trainer import state\n"
        "    return importlib.import_module('ftsup.trainer.bench')\n"
    )
    got = {(i.target, i.lazy) for i in imports_of("ftsup.supervisor.probe", source)}
    assert got == {
        ("os", False), ("ftsup.supervisor", False), ("ftsup.supervisor.sibling", False), ("ftsup.trainer", True),
        ("ftsup.trainer.state", True), ("ftsup.trainer.bench", True),
    }  # fmt: skip
