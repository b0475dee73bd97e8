"""cronlock's layers (docs/development.md): a module imports only modules of its own
layer or of a layer below; no modules import each other, however indirectly; nothing inside
imports `cronlock/__init__.py`, which only re-exports; a module over 600 lines says at its top
why it is one module.

Every import counts wherever it is written: at the top, under `if TYPE_CHECKING:`, inside a
function. An import hidden in a function or kept for the type checker is still a dependency,
and a cycle through one is still a concept split wrongly (CONVENTIONS.md: move the shared
part down).
"""

from __future__ import annotations

import ast
import textwrap
from dataclasses import dataclass
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "cronlock"

# The layers, lowest first, each by the names directly under `cronlock/` that belong to it
# (a folder or a module; "__init__" is the package's own __init__.py). A module may import
# its own layer and those below, never one above. A new name directly under cronlock/ must be
# placed here.
LAYERS: tuple[tuple[str, frozenset[str]], ...] = (
    # What every layer uses: our exceptions, input checks, schema names and SQL text, the
    # settings, the log format, the version, the tracing spans.
    ("base", frozenset({"errors", "inputs", "sql", "settings", "logs", "version", "tracing"})),
    # The pool (PgBouncer-safe), following the primary, lock keys, the schema's migrations.
    ("db", frozenset({"db"})),
    # One run, start to end: schedules, jobs, the runner, ledger, leases, pause, cancel,
    # retries, catch-up, the scheduler, the metrics it counts. No HTTP, no CLI.
    ("core", frozenset({"core"})),
    # The outbox queue, its senders, the mail backends, alerts.
    ("delivery", frozenset({"delivery"})),
    # What an operator reads: views of jobs, runs and locks; schedule export; sizing.
    ("ops", frozenset({"ops"})),
    # The router, its auth, the dashboard, the metrics endpoint.
    ("web", frozenset({"web"})),
    # The command line and the embedded PostgreSQL it starts.
    ("cli", frozenset({"cli"})),
    # What puts the pieces together: the public API, the host app's object, the standalone
    # service, the demo and housekeeping jobs, `python -m cronlock`.
    (
        "top",
        frozenset({"__init__", "__main__", "instance", "service", "demo", "housekeeping"}),
    ),
)

LINE_LIMIT = 600
# A module over LINE_LIMIT lines carries a line starting with this in its docstring, and a
# reason after it.
LONG_MARKER = "Long on purpose:"


@dataclass(frozen=True)
class Import:
    source: str  # the importing module, dotted
    target: str  # the imported module, dotted (the package's name alone: its __init__.py)
    line: int
    names: tuple[str, ...]  # for `from package import names` of the package's __init__.py


def modules(package: Path) -> dict[str, Path]:
    """Every module of `package`, by dotted name (a package by its own name)."""
    found = {}
    for path in sorted(package.rglob("*.py")):
        parts = list(path.relative_to(package.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        found[".".join(parts)] = path
    return found


def imports(package: Path) -> list[Import]:
    """Every import of one of `package`'s modules by another, wherever it is written."""
    known = modules(package)
    root = package.name
    found = []
    for name, path in known.items():
        here = name if path.name == "__init__.py" else name.rpartition(".")[0]
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                for alias in node.names:
                    if alias.name == root or alias.name.startswith(root + "."):
                        target = _known(alias.name, known)
                        found.append(Import(name, target, node.lineno, ()))
            elif isinstance(node, ast.ImportFrom):
                if node.level:
                    base = here.split(".")[: len(here.split(".")) - node.level + 1]
                    module = ".".join([*base, *([node.module] if node.module else [])])
                else:
                    module = node.module or ""
                if module != root and not module.startswith(root + "."):
                    continue
                rest = []
                for alias in node.names:
                    submodule = f"{module}.{alias.name}"
                    if submodule in known:
                        found.append(Import(name, submodule, node.lineno, ()))
                    else:
                        rest.append(alias.name)
                if rest:
                    target = _known(module, known)
                    found.append(Import(name, target, node.lineno, tuple(rest)))
    return found


def _known(dotted: str, known: dict[str, Path]) -> str:
    while dotted not in known and "." in dotted:
        dotted = dotted.rpartition(".")[0]
    return dotted


def layer(module: str) -> int:
    """The index of `module`'s layer in LAYERS; KeyError for a name no layer holds."""
    parts = module.split(".")
    top = parts[1] if len(parts) > 1 else "__init__"
    for index, (_, names) in enumerate(LAYERS):
        if top in names:
            return index
    raise KeyError(module)


def where(package: Path, imp: Import) -> str:
    path = modules(package)[imp.source]
    return f"{path.relative_to(package.parent)}:{imp.line}"


def upward(package: Path) -> list[str]:
    found = []
    for imp in imports(package):
        if layer(imp.target) > layer(imp.source):
            found.append(
                f"{where(package, imp)}: {imp.source} ({LAYERS[layer(imp.source)][0]}) imports "
                f"{imp.target} ({LAYERS[layer(imp.target)][0]}), a layer above"
            )
    return found


def cycles(package: Path) -> list[list[str]]:
    """One cycle through each group of modules that import each other (Tarjan's strongly
    connected components), as the modules in import order, the first repeated at the end."""
    graph: dict[str, set[str]] = {name: set() for name in modules(package)}
    for imp in imports(package):
        if imp.target != imp.source:
            graph[imp.source].add(imp.target)
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    groups: list[set[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        for nxt in sorted(graph[node]):
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            group = set()
            while True:
                member = stack.pop()
                group.add(member)
                if member == node:
                    break
            if len(group) > 1:
                groups.append(group)

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return [_cycle_in(graph, group) for group in groups]


def _cycle_in(graph: dict[str, set[str]], group: set[str]) -> list[str]:
    """A shortest cycle through the group's first module (breadth first, inside the group)."""
    start = min(group)
    paths = {start: [start]}
    queue = [start]
    while queue:
        node = queue.pop(0)
        for nxt in sorted(graph[node] & group):
            if nxt == start:
                return [*paths[node], start]
            if nxt not in paths:
                paths[nxt] = [*paths[node], nxt]
                queue.append(nxt)
    raise AssertionError(group)  # a strongly connected group always has one


def init_imports(package: Path) -> list[str]:
    """Imports of names of the package's __init__.py from inside it (a subpackage or a
    module named in `from cronlock import x` is not one)."""
    return [
        f"{where(package, imp)}: imports {', '.join(imp.names) or package.name} from "
        f"{package.name}/__init__.py; import it from the module that defines it"
        for imp in imports(package)
        if imp.target == package.name and imp.source != package.name
    ]


def long_modules(package: Path) -> list[str]:
    found = []
    for path in modules(package).values():
        text = path.read_text()
        lines = len(text.splitlines())
        if lines <= LINE_LIMIT:
            continue
        doc = ast.get_docstring(ast.parse(text)) or ""
        reasons = [
            line.strip().removeprefix(LONG_MARKER).strip()
            for line in doc.splitlines()
            if line.strip().startswith(LONG_MARKER)
        ]
        if not any(len(reason) >= 20 for reason in reasons):
            found.append(
                f"{path.relative_to(package.parent)}: {lines} lines (over {LINE_LIMIT}): split "
                f"it, or say why it is one module in its docstring, a line starting "
                f"{LONG_MARKER!r}"
            )
    return found


# --- cronlock itself --------------------------------------------------------------------------


def test_every_module_has_a_layer() -> None:
    unplaced = []
    for name in modules(PACKAGE):
        try:
            layer(name)
        except KeyError:
            unplaced.append(name)
    assert unplaced == [], "add these to LAYERS in tests/test_layers.py"


def test_imports_point_downward() -> None:
    assert upward(PACKAGE) == []


def test_no_modules_import_each_other() -> None:
    # One cycle per group of modules that import each other; breaking it may leave another.
    assert [" -> ".join(cycle) for cycle in cycles(PACKAGE)] == []


def test_nothing_inside_imports_the_public_api() -> None:
    assert init_imports(PACKAGE) == []


def test_long_modules_say_why() -> None:
    assert long_modules(PACKAGE) == []


# --- the checks themselves, on a made-up package ----------------------------------------------


def make_package(root: Path, files: dict[str, str]) -> Path:
    package = root / "cronlock"
    for name, text in files.items():
        path = package / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(textwrap.dedent(text))
    for folder in [package, *(p for p in package.rglob("*") if p.is_dir())]:
        (folder / "__init__.py").touch()
    return package


def test_the_checks_see_imports_wherever_they_are_written(tmp_path: Path) -> None:
    """An upward import inside a function, a cycle through `if TYPE_CHECKING:`, a relative
    import, a name taken from the package's __init__.py: each is found."""
    package = make_package(
        tmp_path,
        {
            "__init__.py": "__version__ = '1'\n",
            "sql.py": "def quote() -> None:\n    from cronlock.core.jobs import Job\n",
            "db/lock.py": """\
                from typing import TYPE_CHECKING

                if TYPE_CHECKING:
                    from cronlock.db.pool import Conn
                """,
            "db/pool.py": "from . import lock\n",
            "inputs.py": "",
            "core/jobs.py": "from cronlock import __version__, inputs\n",
            "cli/main.py": "import cronlock.db.pool\nfrom cronlock.core import jobs\n",
        },
    )
    assert upward(package) == [
        "cronlock/core/jobs.py:1: cronlock.core.jobs (core) imports cronlock (top), a layer above",
        "cronlock/sql.py:2: cronlock.sql (base) imports cronlock.core.jobs (core), a layer above",
    ]
    assert cycles(package) == [["cronlock.db.lock", "cronlock.db.pool", "cronlock.db.lock"]]
    assert init_imports(package) == [
        "cronlock/core/jobs.py:1: imports __version__ from cronlock/__init__.py; import it "
        "from the module that defines it"
    ]


def test_a_longer_cycle_is_found_once(tmp_path: Path) -> None:
    package = make_package(
        tmp_path,
        {
            "core/a.py": "from cronlock.core import b\n",
            "core/b.py": "def f() -> None:\n    import cronlock.core.c\n",
            "core/c.py": "from cronlock.core.a import x\n",
            "core/d.py": "from cronlock.core import a\n",
        },
    )
    assert cycles(package) == [
        ["cronlock.core.a", "cronlock.core.b", "cronlock.core.c", "cronlock.core.a"]
    ]
    assert upward(package) == []


def test_a_long_module_needs_its_reason(tmp_path: Path) -> None:
    body = "x = 1\n" * LINE_LIMIT
    package = make_package(
        tmp_path,
        {
            "core/fine.py": '"""Short enough."""\n' + "x = 1\n" * (LINE_LIMIT - 1),
            "core/silent.py": '"""Long, no reason."""\n' + body,
            "core/terse.py": f'"""A module.\n\n{LONG_MARKER} yes.\n"""\n' + body,
            "core/said.py": f'"""A module.\n\n{LONG_MARKER} one state machine, top down."""\n'
            + body,
        },
    )
    assert [problem.split(":")[0] for problem in long_modules(package)] == [
        "cronlock/core/silent.py",
        "cronlock/core/terse.py",
    ]
