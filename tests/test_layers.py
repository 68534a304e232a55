"""The product's imports form a DAG with the ground floor at the bottom (vLLM-free, no process started).

`LAYERS` is the layer order, written down once, lowest first. A module may import modules
of its own group and of any group in a lower layer; groups that share a layer are peers
and import nothing of each other. Imports are read from the source (ast), wherever they
stand (a lazy import inside a function counts), so a module that reaches back up a layer
fails here before anything runs. deploy/ and bench/ sit on top: nothing in the product
imports them.
"""

from __future__ import annotations

import ast
import tomllib
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

LAYERS: list[tuple[str, ...]] = [
    ("pdserve",),  # the namespace root: __version__
    ("pdserve.kernels", "pdserve.kvstore.client"),  # Triton kernels; the store's protocol, layouts, keys, clients
    ("pdserve.kvstore.server", "pdserve.kvstore.connector"),  # the store service; the connector inside vLLM
    ("pdserve.worker",),  # what both worker folders share: flags, supervisor, Redis registration
    ("pdserve.prefill_worker", "pdserve.decode_worker", "pdserve.router"),  # the services
    ("pdserve.deploy",),  # the CLI and launchers: local stack, Ray, Docker
    ("pdserve.bench",),  # benchmarks: import the product, imported by nothing
]

# Modules that must never import vLLM, not even through another pdserve module (at import time):
# the store, the router, the worker supervisor (it checks vLLM in a throwaway interpreter) and the
# connector's pure parts, whose unit tests run without vLLM.
VLLM_FREE = (
    "pdserve.kvstore.client", "pdserve.kvstore.server", "pdserve.router", "pdserve.worker",
    "pdserve.prefill_worker", "pdserve.decode_worker", "pdserve.kvstore.connector.plan",
    "pdserve.kvstore.connector.cache", "pdserve.kvstore.connector.counters",
    "pdserve.kvstore.connector.worker_side", "pdserve.kvstore.connector.vllm_plugin",
    "pdserve.kvstore.connector.vllm_release", "pdserve.deploy.cli", "pdserve.deploy.local",
)


@dataclass(frozen=True)
class Import:
    module: str  # the importing module
    target: str  # the pdserve module (or package) it imports
    line: int
    top_level: bool  # at import time (not inside a function)


def product_modules() -> dict[str, Path]:
    """Every module of the distribution, by dotted name, from pyproject's package map."""
    setuptools = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    dirs = setuptools["package-dir"]
    modules: dict[str, Path] = {}
    for package in setuptools["packages"]:
        base = max((p for p in dirs if package == p or package.startswith(p + ".")), key=len)
        folder = ROOT / dirs[base] / Path(*package[len(base):].split(".")[1:])
        for path in sorted(folder.glob("*.py")):
            modules[package if path.stem == "__init__" else f"{package}.{path.stem}"] = path
    return modules


def imports_of(module: str, source: str, known: set[str]) -> list[Import]:
    """The pdserve modules `source` imports; `from package import name` counts as the module when it is one."""
    found: list[Import] = []

    def visit(parent: ast.AST, top: bool) -> None:  # one pass; `top`: no function encloses the node
        for node in ast.iter_child_nodes(parent):
            if isinstance(node, ast.Import):
                found.extend(Import(module, a.name, node.lineno, top) for a in node.names
                             if a.name.split(".")[0] == "pdserve")
            elif isinstance(node, ast.ImportFrom):
                assert node.level == 0, f"{module}:{node.lineno}: relative import (write the absolute path)"
                if node.module is not None and node.module.split(".")[0] == "pdserve":
                    for alias in node.names:
                        sub = f"{node.module}.{alias.name}"
                        found.append(Import(module, sub if sub in known else node.module, node.lineno, top))
            else:
                visit(node, top and not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)))

    visit(ast.parse(source), True)
    return found


def external_top_level(source: str) -> set[str]:
    """Top-level distribution names imported at import time (outside functions)."""
    names: set[str] = set()
    for node in ast.parse(source).body:
        stmts = [node]
        if isinstance(node, (ast.If, ast.Try)):  # `if TYPE_CHECKING:` blocks run no import; try/except ones do
            if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
                continue
            stmts = [n for n in ast.walk(node) if isinstance(n, (ast.Import, ast.ImportFrom))]
        for stmt in stmts:
            if isinstance(stmt, ast.Import):
                names |= {a.name.split(".")[0] for a in stmt.names}
            elif isinstance(stmt, ast.ImportFrom) and stmt.module:
                names.add(stmt.module.split(".")[0])
    return names


def group_of(module: str) -> str | None:
    groups = [g for layer in LAYERS for g in layer if module == g or module.startswith(g + ".")]
    return max(groups, key=len) if groups else None


def layer_of(group: str) -> int:
    return next(i for i, layer in enumerate(LAYERS) if group in layer)


def violations(imports: list[Import]) -> list[str]:
    """Imports that run back up a layer or sideways to a peer group."""
    out = []
    for imp in imports:
        source, target = group_of(imp.module), group_of(imp.target)
        assert source is not None and target is not None, imp
        if source != target and layer_of(target) >= layer_of(source):
            out.append(f"{imp.module}:{imp.line} imports {imp.target} ({target} is not below {source})")
    return out


@pytest.fixture(scope="module")
def sources() -> dict[str, str]:
    return {name: path.read_text() for name, path in product_modules().items()}


@pytest.fixture(scope="module")
def all_imports(sources: dict[str, str]) -> list[Import]:
    known = set(sources)
    return [imp for name, text in sources.items() for imp in imports_of(name, text, known)]


def test_every_package_has_a_place_in_the_layer_order(sources: dict[str, str]) -> None:
    unplaced = sorted(m for m in sources if group_of(m) is None)
    assert not unplaced, f"add these to LAYERS: {unplaced}"
    named = {g for layer in LAYERS for g in layer}
    assert named <= {group_of(m) for m in sources}, "LAYERS names a package that does not exist"


def _defined(source: str) -> set[str]:
    """Names a module defines at its top level."""
    names: set[str] = set()
    for node in ast.parse(source).body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            names |= {n.id for n in ast.walk(node) if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Store)}
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            names |= {(a.asname or a.name).split(".")[0] for a in node.names}
    return names


def test_every_import_names_something_that_exists(sources: dict[str, str], all_imports: list[Import]) -> None:
    """Every pdserve import of the product and the tests: the module exists, and `from X import name`
    names a module or something X defines (a moved module's old path fails here, not at run time)."""
    missing = [f"{i.module}:{i.line} imports {i.target}" for i in all_imports if i.target not in sources]
    defined = {name: _defined(text) for name, text in sources.items()}  # each module parsed once, not per import
    for path in sorted((ROOT / "tests").glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                missing += [f"{path.name}:{node.lineno} imports {a.name}" for a in node.names
                            if a.name.startswith("pdserve.") and a.name not in sources]
            elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith("pdserve"):
                if node.module not in sources:
                    missing.append(f"{path.name}:{node.lineno} imports {node.module}")
                    continue
                missing += [f"{path.name}:{node.lineno} imports {node.module}.{a.name}" for a in node.names
                            if f"{node.module}.{a.name}" not in sources and a.name not in defined[node.module]]
    for name, text in sources.items():
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, ast.ImportFrom) and node.module in sources:
                missing += [f"{name}:{node.lineno} imports {node.module}.{a.name}" for a in node.names
                            if f"{node.module}.{a.name}" not in sources and a.name not in defined[node.module]]
    assert missing == []


def test_imports_only_go_down_the_layers(all_imports: list[Import]) -> None:
    assert violations(all_imports) == []


def test_module_imports_have_no_cycle(all_imports: list[Import]) -> None:
    graph: dict[str, set[str]] = {}
    for imp in all_imports:
        if imp.top_level and imp.target != imp.module:
            graph.setdefault(imp.module, set()).add(imp.target)
    state: dict[str, int] = {}  # 1: on the path, 2: done

    def visit(node: str, path: list[str]) -> list[str] | None:
        state[node] = 1
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return path + [node, nxt]
            if nxt not in state and (cycle := visit(nxt, path + [node])):
                return cycle
        state[node] = 2
        return None

    cycles = [c for m in sorted(graph) if m not in state and (c := visit(m, []))]
    assert cycles == []


def test_a_backwards_import_is_caught() -> None:
    """The check itself: the router reaching up into deploy/, and a peer into its peer, both fail."""
    known = {"pdserve.deploy.local", "pdserve.kvstore.connector.plan", "pdserve.kvstore.server.store"}
    up = imports_of("pdserve.router.app", "def f():\n    from pdserve.deploy.local import LocalStack\n", known)
    side = imports_of("pdserve.kvstore.server.store", "import pdserve.kvstore.connector.plan\n", known)
    down = imports_of("pdserve.deploy.local", "from pdserve.kvstore.server import store\n", known)
    assert [v.split(" (")[0] for v in violations(up + side + down)] == [
        "pdserve.router.app:2 imports pdserve.deploy.local",
        "pdserve.kvstore.server.store:1 imports pdserve.kvstore.connector.plan",
    ]


def test_the_store_router_and_workers_never_import_vllm(sources: dict[str, str], all_imports: list[Import]) -> None:
    deps: dict[str, set[str]] = {}
    for imp in all_imports:
        if imp.top_level and imp.target in sources:
            deps.setdefault(imp.module, set()).add(imp.target)
        if imp.top_level and imp.target.rsplit(".", 1)[0] in sources:  # `from pkg import mod` loads pkg too
            deps.setdefault(imp.module, set()).add(imp.target.rsplit(".", 1)[0])

    def reaches_vllm(module: str) -> list[str] | None:
        seen, todo = {module: [module]}, [module]
        while todo:
            cur = todo.pop()
            if "vllm" in external_top_level(sources[cur]):
                return seen[cur]
            for nxt in deps.get(cur, ()):
                if nxt not in seen:
                    seen[nxt] = seen[cur] + [nxt]
                    todo.append(nxt)
        return None

    checked = [m for m in sources if any(m == f or m.startswith(f + ".") for f in VLLM_FREE)]
    assert len(checked) > 30
    assert {m: chain for m in checked if (chain := reaches_vllm(m))} == {}


def imported_distributions(source: str) -> set[str]:
    """Top-level names of every import in `source`, wherever it stands (lazy ones count)."""
    names: set[str] = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            names |= {a.name.split(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module.split(".")[0])
    return names


def test_nothing_imports_lmcache(sources: dict[str, str]) -> None:
    """LMCache is an optional backend that runs in its own processes: vLLM loads its connector by
    module path, `lmcache server` is a child process, and pdserve speaks its wire itself
    (kvstore/client/lmcache_mp.py). No module of pdserve imports it, lazily or not."""
    assert [m for m, src in sources.items() if "lmcache" in imported_distributions(src)] == []
    assert "lmcache" in imported_distributions("def f():\n    import lmcache.cli.main\n")  # the check itself


def test_entry_points_name_modules_that_exist(sources: dict[str, str]) -> None:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    targets = [*project["scripts"].values(), *project["entry-points"]["vllm.general_plugins"].values()]
    for target in targets:
        module, attr = target.split(":")
        assert module in sources, target
        defined = {n.name for n in ast.parse(sources[module]).body if isinstance(n, (ast.FunctionDef, ast.ClassDef))}
        assert attr in defined, target


def test_collecting_the_tests_imports_no_vllm(vllm_imported_by_collection: list[str]) -> None:
    """A test that needs vLLM imports it itself (and is marked engine or slow): then `make test-fast`,
    which deselects those, never pays for the import."""
    assert vllm_imported_by_collection == []

