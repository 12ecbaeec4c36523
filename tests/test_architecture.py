"""The package's shape, checked: no import cycle, no module reaching into another's private
names, no function too long to read, and api.py a short driver."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[1] / "src" / "onnxmedic"
PACKAGE = "onnxmedic"

# Functions allowed over MAX_LINES: declarative tables, not logic.
LONG_ALLOWED = {"cli.py:build_parser"}
MAX_LINES = 80


def _modules() -> dict[str, Path]:
    out = {}
    for p in sorted(SRC.rglob("*.py")):
        rel = p.relative_to(SRC.parent).with_suffix("")
        parts = list(rel.parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = p
    return out


MODULES = _modules()


def _resolve(name: str) -> str | None:
    """The package module an import names (``a.b.c`` may be module ``a.b`` plus a name)."""
    while name:
        if name in MODULES:
            return name
        name = name.rpartition(".")[0]
    return None


def _imports(mod: str, path: Path, top_level_only: bool, runtime_only: bool = False
             ) -> list[tuple[str, list[str], int]]:
    """(imported module, names imported from it, line) for each onnxmedic import
    (``runtime_only``: not those under ``if TYPE_CHECKING``, for annotations only)."""
    tree = ast.parse(path.read_text())
    typing_only = {id(n) for b in ast.walk(tree) if runtime_only and isinstance(b, ast.If)
                   and "TYPE_CHECKING" in ast.unparse(b.test) for s in b.body
                   for n in ast.walk(s)}
    nodes = tree.body if top_level_only else [n for n in ast.walk(tree)
                                              if id(n) not in typing_only]
    if top_level_only:  # also imports under a top-level `if`/`try` (not TYPE_CHECKING)
        extra = []
        for n in tree.body:
            if isinstance(n, ast.Try):
                extra += n.body
            elif isinstance(n, ast.If) and "TYPE_CHECKING" not in ast.unparse(n.test):
                extra += n.body
        nodes = nodes + extra
    package = mod if path.name == "__init__.py" else mod.rpartition(".")[0]
    out = []
    for n in nodes:
        if isinstance(n, ast.Import):
            for a in n.names:
                if a.name.startswith(PACKAGE):
                    out.append((a.name, [], n.lineno))
        elif isinstance(n, ast.ImportFrom):
            if n.level:
                base = package.split(".")
                base = base[: len(base) - (n.level - 1)]
                full = ".".join(base + ([n.module] if n.module else []))
            else:
                full = n.module or ""
            if not full.startswith(PACKAGE):
                continue
            for a in n.names:
                sub = f"{full}.{a.name}"
                if sub in MODULES:  # `from onnxmedic import sandbox`: a module, not a name
                    out.append((sub, [], n.lineno))
                else:
                    out.append((full, [a.name], n.lineno))
    return out


def _graph(top_level_only: bool) -> dict[str, set[str]]:
    graph: dict[str, set[str]] = {m: set() for m in MODULES}
    for mod, path in MODULES.items():
        for target, _names, _line in _imports(mod, path, top_level_only, runtime_only=True):
            dep = _resolve(target)
            if dep is not None and dep != mod:
                graph[mod].add(dep)
    return graph


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(m: str) -> list[str] | None:
        state[m] = 1
        stack.append(m)
        for d in sorted(graph[m]):
            if state.get(d) == 1:
                return stack[stack.index(d):] + [d]
            if d not in state:
                found = visit(d)
                if found:
                    return found
        stack.pop()
        state[m] = 2
        return None

    for m in sorted(graph):
        if m not in state:
            found = visit(m)
            if found:
                return found
    return None


def test_no_import_cycle_at_module_level():
    """What Python itself imports when a module loads: a cycle here breaks import order.
    (A package's __init__ re-exporting its own modules is not a cycle of its modules.)"""
    graph = _graph(top_level_only=True)
    for m in graph:  # a package imports its children; children may import siblings
        graph[m] = {d for d in graph[m] if not (m.startswith(d + ".") and d != PACKAGE)}
    graph[PACKAGE] = set()  # the public facade re-exports; nothing inside imports it back
    cycle = _cycle(graph)
    assert cycle is None, " -> ".join(cycle or [])


def test_no_import_cycle_at_all():
    """Imports inside functions too: a module that imports another only when called still
    depends on it, and a cycle through such an import is a knot a reader must untie (the
    facade counts as what it imports: a module that imports ``onnxmedic`` itself depends on
    the whole package)."""
    graph = _graph(top_level_only=False)
    for m in graph:  # a package's own children are not its dependencies
        graph[m] = {d for d in graph[m] if not (m.startswith(d + ".") and d != PACKAGE)}
    cycle = _cycle(graph)
    assert cycle is None, " -> ".join(cycle or [])


# the generation domain's layers: hf/ reaches optimize's generic passes only from its package
# transforms; optimize/ imports nothing of hf/ except the command's dispatch of a package
# folder; both read a package through the contract (genpackage.py), which imports neither
LAYERS = {"onnxmedic.hf": ("onnxmedic.optimize", {"onnxmedic.hf.transforms"}),
          "onnxmedic.optimize": ("onnxmedic.hf", {"onnxmedic.optimize.cli"}),
          "onnxmedic.genpackage": ("onnxmedic.", set())}


def _layer_breaks(graph: dict[str, set[str]]) -> list[str]:
    out = []
    for layer, (forbidden, allowed) in LAYERS.items():
        for m, deps in graph.items():
            if not (m == layer or m.startswith(layer + ".")) or any(
                    m == a or m.startswith(a + ".") for a in allowed):
                continue
            out += [f"{m} -> {d}" for d in sorted(deps)
                    if (d == forbidden or d.startswith(forbidden.rstrip(".") + "."))
                    and d != m]
    return out


def test_hf_and_optimize_do_not_import_each_other():
    assert _layer_breaks(_graph(top_level_only=False)) == []


def test_the_layer_check_finds_a_break():
    assert _layer_breaks({"onnxmedic.optimize.int4": {"onnxmedic.hf.gen_verify"},
                          "onnxmedic.hf.generation": {"onnxmedic.optimize.int4"},
                          "onnxmedic.hf.transforms.gqa": {"onnxmedic.optimize.int4"},
                          "onnxmedic.genpackage": {"onnxmedic.findings"}}) == [
        "onnxmedic.hf.generation -> onnxmedic.optimize.int4",
        "onnxmedic.optimize.int4 -> onnxmedic.hf.gen_verify",
        "onnxmedic.genpackage -> onnxmedic.findings"]


def test_the_cycle_check_finds_a_cycle():
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert _cycle({"a": {"b"}, "b": set()}) is None


def test_no_module_imports_a_private_name_of_another():
    bad = []
    for mod, path in MODULES.items():
        for target, names, line in _imports(mod, path, top_level_only=False):
            dep = _resolve(target)
            if dep == mod:
                continue
            for name in names:
                if name.startswith("_") and not name.startswith("__"):
                    bad.append(f"{path.relative_to(SRC)}:{line} imports {name} from {target}")
    assert not bad, "\n".join(bad)


def test_no_function_over_80_lines():
    long = []
    for path in SRC.rglob("*.py"):
        for n in ast.walk(ast.parse(path.read_text())):
            if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)):
                lines = n.end_lineno - n.lineno + 1
                key = f"{path.relative_to(SRC)}:{n.name}"
                if lines > MAX_LINES and key not in LONG_ALLOWED:
                    long.append(f"{key} ({lines} lines)")
    assert not long, "\n".join(long)


def test_api_is_a_short_driver():
    api = (SRC / "api.py").read_text()
    assert len(api.splitlines()) <= 500
    assert "stages[" not in api  # stages record their own status


@pytest.mark.parametrize("path", sorted(str(p.relative_to(SRC)) for p in SRC.rglob("*.py")))
def test_no_stage_status_is_assigned_by_hand(path):
    """Only result.py writes a stage's status (``with result.stage(...)``, ``fail``)."""
    if path == "result.py":
        return
    text = (SRC / path).read_text()
    assert ".stages[" not in text.replace(".stages.get(", "")
    tree = ast.parse(text)
    for n in ast.walk(tree):
        if isinstance(n, ast.Assign):
            for t in n.targets:
                assert not (isinstance(t, ast.Subscript) and "stages" in ast.unparse(t.value)), \
                    f"{path}:{n.lineno} assigns a stage status"


# torch-private names every module may use: torch's own documentation uses them (torch.export's
# types and tree helpers; torch._C's dispatch keys and disabled torch-function in the guides to
# extending torch; torch._check in the guide to dynamic shapes)
TORCH_PRIVATE_ALLOWED = {"torch.utils._pytree", "torch._ops"}
TORCH_ATTRS_ALLOWED = {"_check", "_assert_async", "_ops", "_C"}


def _torch_private_uses(path: Path, root: Path = SRC) -> list[str]:
    out = []
    where = path.relative_to(root)
    for n in ast.walk(ast.parse(path.read_text())):
        names = ([a.name for a in n.names] if isinstance(n, ast.Import) else
                 [n.module] if isinstance(n, ast.ImportFrom) and n.module else [])
        out += [f"{where}:{n.lineno} imports {m}" for m in names
                if m.split(".")[0] == "torch" and m not in TORCH_PRIVATE_ALLOWED
                and any(c.startswith("_") for c in m.split(".")[1:])]
        if isinstance(n, ast.Attribute) and isinstance(n.value, ast.Name) and \
                n.value.id == "torch" and n.attr.startswith("_") and \
                not n.attr.startswith("__") and n.attr not in TORCH_ATTRS_ALLOWED:
            out.append(f"{where}:{n.lineno} uses torch.{n.attr}")
    return out


def test_torch_private_apis_only_in_torch_compat():
    """The design's rule: when a torch release moves a private API, _torch_compat.py is the
    only file to change."""
    bad = [u for p in sorted(SRC.rglob("*.py")) if p.name != "_torch_compat.py"
           for u in _torch_private_uses(p)]
    assert not bad, "\n".join(bad)


def test_the_private_api_check_finds_one(tmp_path):
    """The probe file lives in tmp_path: the source tree is never written to."""
    p = tmp_path / "_probe_private_use.py"
    p.write_text("import torch\nfrom torch._subclasses.fake_tensor import FakeTensor\n"
                 "t = torch._decomp.decomposition_table\n")
    uses = _torch_private_uses(p, root=tmp_path)
    assert [u.split(" ", 1)[1] for u in uses] == [
        "imports torch._subclasses.fake_tensor", "uses torch._decomp"]
    assert uses[0].startswith("_probe_private_use.py:2 ")


TESTS = Path(__file__).resolve().parent


def _private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")


def _test_private_uses(path: Path, root: Path = TESTS) -> list[str]:
    """Where a test file reaches a private name of an onnxmedic module: ``from m import _x``,
    ``m._x`` (``m`` bound to an onnxmedic module), ``setattr(m, "_x", ...)`` (monkeypatch) and
    ``"onnxmedic.m._x"`` as a patch target. A module whose own name is private (_torch_compat,
    _tensors, ...) is a module of the package, not a name inside one: its tests import it."""
    tree = ast.parse(path.read_text())
    where = path.relative_to(root)
    bound: dict[str, str] = {}  # local name -> the onnxmedic module it is bound to
    out = []
    for n in ast.walk(tree):
        if isinstance(n, ast.Import):
            for a in n.names:
                if a.name.split(".")[0] == PACKAGE:
                    bound[a.asname or PACKAGE] = a.name if a.asname else PACKAGE
        elif isinstance(n, ast.ImportFrom) and n.module and n.module.split(".")[0] == PACKAGE:
            for a in n.names:
                full = f"{n.module}.{a.name}"
                if full in MODULES:
                    bound[a.asname or a.name] = full
                elif _private(a.name):
                    out.append(f"{where}:{n.lineno} imports {a.name} from {n.module}")
    for n in ast.walk(tree):
        if isinstance(n, ast.Attribute) and _private(n.attr):
            chain, v = [n.attr], n.value
            while isinstance(v, ast.Attribute):
                chain.insert(0, v.attr)
                v = v.value
            if isinstance(v, ast.Name) and v.id in bound:
                full = ".".join([bound[v.id], *chain])
                if full not in MODULES:
                    out.append(f"{where}:{n.lineno} uses {full}")
        elif isinstance(n, ast.Call) and n.args:
            first, second = n.args[0], n.args[1] if len(n.args) > 1 else None
            if (isinstance(first, ast.Name) and first.id in bound
                    and isinstance(second, ast.Constant) and isinstance(second.value, str)
                    and _private(second.value)):
                out.append(f"{where}:{n.lineno} patches {bound[first.id]}.{second.value}")
            if (isinstance(first, ast.Constant) and isinstance(first.value, str)
                    and first.value.split(".")[0] == PACKAGE
                    and any(_private(p) for p in first.value.split("."))
                    and first.value not in MODULES):
                out.append(f"{where}:{n.lineno} patches {first.value}")
    return sorted(out, key=lambda u: int(u.split(" ", 1)[0].rsplit(":", 1)[1]))


def test_no_test_uses_a_private_name():
    """Tests go through the names a module offers; a name a test needs is public (issue 42)."""
    bad = [u for p in sorted(TESTS.rglob("*.py")) for u in _test_private_uses(p)]
    assert not bad, "\n".join(bad)


def test_the_private_name_check_finds_one(tmp_path):
    p = tmp_path / "test_probe.py"
    p.write_text("from onnxmedic import sandbox\nfrom onnxmedic.borrow import _x\n"
                 "from onnxmedic import _tensors\n"
                 "def test(monkeypatch):\n    sandbox._SERVER.get()\n"
                 "    monkeypatch.setattr(sandbox, '_y', 1)\n"
                 "    monkeypatch.setattr('onnxmedic.cli._z', 1)\n    _tensors.to_numpy\n")
    assert [u.split(" ", 1)[1] for u in _test_private_uses(p, root=tmp_path)] == [
        "imports _x from onnxmedic.borrow", "uses onnxmedic.sandbox._SERVER",
        "patches onnxmedic.sandbox._y", "patches onnxmedic.cli._z"]


def test_every_stage_lives_in_the_module_named_after_it():
    """One layout for the pipeline: stage ``name`` is ``stages/<name>.py``'s function, and
    stages/ holds the declared stages only."""
    from onnxmedic.pipeline import EXPORT_STAGES
    from onnxmedic.stages import STAGE_NAMES

    where = {s.name: s.run.__module__ for s in EXPORT_STAGES}
    assert where == {n: f"{PACKAGE}.stages.{n}" for n in STAGE_NAMES}
    modules = {p.stem for p in (SRC / "stages").glob("*.py")} - {"__init__"}
    assert modules == set(STAGE_NAMES)
