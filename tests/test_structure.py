"""The shape of gateway/ that keeps it readable, checked on the source (AST), not by review:

- no function with more than 6 parameters besides self/cls (keyword-only options excepted);
- no function longer than 60 lines;
- no module longer than 600 lines, unless it is named in LONG_MODULES with its reason;
- no function-local import of a first-party module (a hidden dependency, and an import cycle
  waiting to happen); the CLI's lazy loading goes through `gateway.cli`'s registry instead;
- the pure stages import no asyncio and no network library, directly or through first-party
  modules they import.
"""
from __future__ import annotations

import ast
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
GATEWAY = REPO / "gateway"
FIRST_PARTY = ("gateway", "replica_agent", "hashing", "policies", "loadtests")
MAX_PARAMS = 6
MAX_FUNCTION_LINES = 60
MAX_MODULE_LINES = 600
# module -> why it may be longer than MAX_MODULE_LINES
LONG_MODULES: dict[str, str] = {}
# the stages that decide, parse or compute: plain Python over plain data
PURE_MODULES = ("gateway.parse", "gateway.rewrite", "gateway.learn", "gateway.routing", "gateway.context",
                "gateway.errors", "gateway.index", "gateway.load", "gateway.model", "gateway.state", "gateway.salt",
                "gateway.auth", "gateway.fairness", "gateway.admission")
IO_MODULES = ("asyncio", "aiohttp", "httptools", "httpx", "socket", "uvloop", "zmq", "redis", "grpc", "requests",
              "urllib3", "ssl", "selectors")


def _modules():
    for path in sorted(GATEWAY.rglob("*.py")):
        if "_pb2" in path.name:  # generated protobuf code
            continue
        yield path, ast.parse(path.read_text(), filename=str(path))


def _functions(tree):
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            yield node


def _where(path: Path, node) -> str:
    return f"{path.relative_to(REPO)}:{node.lineno} {getattr(node, 'name', '')}"


def test_functions_take_few_positional_parameters():
    bad = []
    for path, tree in _modules():
        for fn in _functions(tree):
            params = [a.arg for a in fn.args.posonlyargs + fn.args.args if a.arg not in ("self", "cls")]
            if len(params) > MAX_PARAMS:
                bad.append(f"{_where(path, fn)}: {len(params)} parameters")
    assert not bad, "too many parameters (make options keyword-only or pass a record):\n" + "\n".join(bad)


def test_functions_are_short():
    bad = []
    for path, tree in _modules():
        for fn in _functions(tree):
            n = fn.end_lineno - fn.lineno + 1
            if n > MAX_FUNCTION_LINES:
                bad.append(f"{_where(path, fn)}: {n} lines")
    assert not bad, f"functions over {MAX_FUNCTION_LINES} lines:\n" + "\n".join(bad)


def test_modules_fit_one_reader():
    bad = []
    for path, _ in _modules():
        name = ".".join(path.relative_to(REPO).with_suffix("").parts)
        n = len(path.read_text().splitlines())
        if n > MAX_MODULE_LINES and name not in LONG_MODULES:
            bad.append(f"{path.relative_to(REPO)}: {n} lines")
    assert not bad, f"modules over {MAX_MODULE_LINES} lines (split by responsibility, or name the reason):\n" + "\n".join(bad)


def test_no_function_local_first_party_imports():
    bad = []
    for path, tree in _modules():
        for fn in _functions(tree):
            for node in ast.walk(fn):
                mod = None
                if isinstance(node, ast.ImportFrom):
                    mod = "." if node.level else (node.module or "")
                elif isinstance(node, ast.Import):
                    mod = node.names[0].name
                if mod is not None and (mod == "." or mod.split(".")[0] in FIRST_PARTY):
                    bad.append(f"{_where(path, fn)}: imports {mod}")
    assert not bad, "function-local first-party imports (import at the top):\n" + "\n".join(bad)


def _module_path(name: str) -> Path | None:
    base = REPO.joinpath(*name.split("."))
    for cand in (base.with_suffix(".py"), base / "__init__.py"):
        if cand.exists():
            return cand
    return None


def _top_level_imports(name: str) -> set[str]:
    """Modules imported at module level (not inside functions) by first-party module `name`."""
    path = _module_path(name)
    tree = ast.parse(path.read_text())
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    out: set[str] = set()
    for node in tree.body:
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                mod = ".".join(base + ([node.module] if node.module else []))
                out.add(mod)
                out.update(f"{mod}.{a.name}" for a in node.names)  # `from . import x` imports a module
            else:
                out.add(node.module or "")
                out.update(f"{node.module}.{a.name}" for a in node.names)
    return out


@pytest.mark.parametrize("module", PURE_MODULES)
def test_pure_stages_import_no_io(module):
    """The pure module and every first-party module it imports at top level (transitively) import
    no I/O library themselves (what third-party libraries do inside is theirs)."""
    seen, todo, bad = set(), [module], []
    while todo:
        name = todo.pop()
        if name in seen or _module_path(name) is None:
            continue
        seen.add(name)
        for imp in _top_level_imports(name):
            if imp.split(".")[0] in IO_MODULES:
                bad.append(f"{name} imports {imp}")
            elif imp.split(".")[0] in FIRST_PARTY:
                todo.append(imp)
    assert not bad, f"{module} reaches I/O: " + "; ".join(sorted(bad))


def test_services_wait_with_asyncio_timeout_not_wait_for():
    """Python 3.11's `asyncio.wait_for` returns the inner result when the outer task is cancelled
    in the same loop turn as the awaited thing completes, and the cancel is lost: a background
    loop waiting on an event with it can outlive close() (a shutdown hang CI found; the behaviour
    is pinned in tests/test_cancel_at_wake.py). The services use `async with asyncio.timeout(...)`."""
    bad = []
    for package in ("gateway", "replica_agent", "hashing", "policies"):
        for path in sorted((REPO / package).rglob("*.py")):
            for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
                if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "wait_for"
                        and isinstance(node.func.value, ast.Name) and node.func.value.id == "asyncio"):
                    bad.append(_where(path, node))
    assert not bad, "asyncio.wait_for in a service (use asyncio.timeout):\n" + "\n".join(bad)
