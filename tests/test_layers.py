"""Where a file sits tells its layer, and the import graph goes one way, with no cycle anywhere.

Layers, read from each module's folder (no list of modules):

0. ``base/`` (``dartree.base``): the utilities every layer may use; imports nothing of dartree;
1. ``kernels/``;
2. ``models/`` (and its sub-packages);
3. the libraries ``decode/``, ``training/``, ``convert/``: each imports lower layers and itself, never another library;
4. programs: every module inside a programs sub-folder (``tools/``, and ``decode/harness/``, the evaluation harness),
   and every thin script at a documented path (a module docstring, one ``from ... import main`` and
   ``if __name__ == "__main__": raise SystemExit(main())``, recognised by that structure); programs import anything
   below them and each other;
5. the top-level Python API (``api/``, package ``dartree``): imports anything; nothing imports it.

Every ``import`` / ``from ... import`` of a ``dartree`` module counts, at module level or inside a function, and so
does a call ``importlib.import_module("dartree...")`` with a string literal (an import by another spelling). An
import inside a function is allowed only with a stated reason: a comment starting ``# lazy:`` on the line above or
on the same line (an optional heavy dependency, a cycle that cannot be broken, or a program that keeps ``--help``
and its light stages fast by not importing torch-heavy modules).
"""

import ast
import tomllib
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
LIBRARY_RANK = {"base": 0, "kernels": 1, "models": 2, "decode": 3, "training": 3, "convert": 3}
PROGRAM_FOLDERS = {"tools", "harness"}  # the names of programs sub-folders
PROGRAM, API = 4, 5


def _package_dirs() -> dict[str, str]:
    """{package: folder} from pyproject.toml's [tool.setuptools.package-dir] (``dartree`` is ``api/``)."""
    with open(REPO / "pyproject.toml", "rb") as f:
        return tomllib.load(f)["tool"]["setuptools"]["package-dir"]


def _modules() -> dict[str, Path]:
    """{dotted module name: file} of every module of every package."""
    out = {}
    for pkg, folder in _package_dirs().items():
        for f in sorted((REPO / folder).glob("*.py")):
            out[pkg if f.stem == "__init__" else f"{pkg}.{f.stem}"] = f
    return out


def is_thin_script(tree: ast.Module) -> bool:
    """A documented command kept at its path as a thin script: a module docstring, ``from X import main`` (an
    ``import sys`` allowed) and ``if __name__ == "__main__":`` that exits with ``main()``'s status; nothing else."""
    body = list(tree.body)
    if not (body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant)
            and isinstance(body[0].value.value, str)):
        return False
    body = [n for n in body[1:] if not (isinstance(n, ast.Import) and [a.name for a in n.names] == ["sys"])]
    if len(body) != 2 or not isinstance(body[0], ast.ImportFrom) or [a.name for a in body[0].names] != ["main"]:
        return False
    guard = body[1]
    return (isinstance(guard, ast.If) and ast.unparse(guard.test) in ('__name__ == "__main__"', "__name__ == '__main__'")
            and len(guard.body) == 1 and ast.unparse(guard.body[0]) in ("raise SystemExit(main())", "sys.exit(main())"))


def layer(module: str, thin: bool = False) -> tuple[str, int]:
    """(package, layer) of ``module`` from where it sits: its top-level folder's rank, :data:`PROGRAM` inside a
    programs sub-folder or for a thin script, :data:`API` for the top-level API (package ``""``)."""
    parts = module.split(".")[1:]
    if not parts or parts[0] not in LIBRARY_RANK:
        return "", API
    if thin or any(p in PROGRAM_FOLDERS for p in parts[1:]):
        return parts[0], PROGRAM
    return parts[0], LIBRARY_RANK[parts[0]]


def _import_module_name(node: ast.AST) -> str | None:
    """The module a call ``import_module("dartree...")`` / ``importlib.import_module("dartree...")`` names with a
    string literal (an import all the same), else None."""
    if not isinstance(node, ast.Call) or not node.args:
        return None
    func, arg = node.func, node.args[0]
    name = func.id if isinstance(func, ast.Name) else func.attr if isinstance(func, ast.Attribute) else ""
    if name == "import_module" and isinstance(arg, ast.Constant) and isinstance(arg.value, str):
        return arg.value if arg.value.startswith("dartree") else None
    return None


def _imports(tree: ast.Module) -> list[tuple[ast.AST, list[str], bool]]:
    """(node, the dartree names it imports, at module level?) for every import in ``tree``: import statements and
    ``import_module`` calls with a string literal (:func:`_import_module_name`)."""
    top = {id(n) for n in tree.body}
    top |= {id(n.value) for n in tree.body if isinstance(n, (ast.Expr, ast.Assign))}  # a module-level call
    out = []
    for node in ast.walk(tree):
        names = []
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("dartree"):
            names = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
        elif isinstance(node, ast.Import):
            names = [a.name for a in node.names if a.name.startswith("dartree")]
        elif _import_module_name(node):
            names = [_import_module_name(node)]
        if names:
            out.append((node, names, id(node) in top))
    return out


def unexplained_lazy_imports(text: str, where: str = "") -> list[str]:
    """The dartree imports inside functions of module source ``text`` with no ``# lazy:`` reason: on the same line,
    on the line above, or above the run of consecutive imports it belongs to; as ``where:LINE statement``."""
    lines = text.splitlines()
    found = _imports(ast.parse(text))
    import_lines = {ln for node, _, _ in found for ln in range(node.lineno, node.end_lineno + 1)}
    out = []
    for node, _, at_top in found:
        if at_top or "# lazy:" in lines[node.lineno - 1]:
            continue
        ln = node.lineno - 1  # walk up over the imports just above it
        while ln >= 1 and (ln in import_lines or lines[ln - 1].strip().startswith(("from ", "import "))):
            ln -= 1
        if ln < 1 or not lines[ln - 1].strip().startswith("# lazy:"):
            out.append(f"{where}:{node.lineno} {lines[node.lineno - 1].strip()}")
    return out


def scan() -> tuple[dict[str, set[str]], dict[str, int], list[str]]:
    """(import graph {module: the dartree modules it imports}, {module: layer}, function-level dartree imports
    without a ``# lazy:`` reason), from the source of every module (module level and functions)."""
    mods = _modules()
    graph, ranks, unexplained = {m: set() for m in mods}, {}, []
    for m, f in mods.items():
        text = f.read_text()
        tree = ast.parse(text, str(f))
        ranks[m] = layer(m, is_thin_script(tree))[1]
        for _, names, _ in _imports(tree):
            graph[m].update(n for n in names if n in mods and n != m)
        unexplained += unexplained_lazy_imports(text, str(f.relative_to(REPO)))
    return graph, ranks, unexplained


def import_graph() -> dict[str, set[str]]:
    """{module: the dartree modules it imports}."""
    return scan()[0]


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan 1972)."""
    index, low, stack, on, out = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in graph:
        if v not in index:
            visit(v)
    return out


def back_edges(graph: dict[str, set[str]], thin: frozenset = frozenset()) -> list[str]:
    """Imports that go up a layer, sideways from one library into another, or into the top-level API. ``thin``: the
    modules that are thin scripts."""
    bad = []
    for a, targets in graph.items():
        pa, ra = layer(a, a in thin)
        for b in targets:
            pb, rb = layer(b, b in thin)
            if ra == API:
                ok = True
            elif ra == PROGRAM:
                ok = rb <= PROGRAM
            else:
                ok = rb < ra or (rb == ra and pa == pb)
            if not ok:
                bad.append(f"{a} -> {b}")
    return sorted(bad)


def _thin_modules() -> frozenset:
    return frozenset(m for m, f in _modules().items() if is_thin_script(ast.parse(f.read_text())))


def test_the_import_graph_has_no_back_edge_and_no_cycle():
    graph, ranks, _ = scan()
    assert len(graph) > 60 and graph["dartree.decode.generate"]  # the walk found the modules and their imports
    assert back_edges(graph, _thin_modules()) == []
    assert _cycles(graph) == []
    # the layers come from the folders: base imports nothing of dartree, programs sit in programs folders
    assert [b for a in graph if a.startswith("dartree.base") for b in graph[a] if not b.startswith("dartree.base")] == []
    assert ranks["dartree.kernels.tools.gpu_check"] == ranks["dartree.training.tools.campaign"] == PROGRAM
    assert ranks["dartree.decode.harness.report"] == PROGRAM and ranks["dartree.decode.generate"] == 3
    # the documented commands are thin scripts at their paths
    assert {"dartree.training.train", "dartree.convert.to_dartree", "dartree.convert.from_dartree",
            "dartree.decode.eval"} <= _thin_modules()


def test_the_report_does_not_import_training():
    graph = import_graph()
    for m in ("report", "report_figures", "report_command"):
        assert [b for b in graph[f"dartree.decode.harness.{m}"] if b.startswith("dartree.training")] == []


def test_every_import_inside_a_function_states_why():
    assert scan()[2] == []


def test_the_checks_catch_a_back_edge_a_cycle_and_an_unexplained_lazy_import(tmp_path):
    graph = {"dartree.models.target": {"dartree.decode.trees"}, "dartree.decode.trees": {"dartree.decode.verify"},
             "dartree.decode.verify": {"dartree.decode.trees"},
             "dartree.decode.harness.eval": {"dartree.training.data", "dartree.training.tools.campaign"},
             "dartree.training.data": {"dartree.decode.generate", "dartree.base.cli"},
             "dartree.decode.generate": {"dartree.decode.harness.session"}, "dartree.decode.harness.session": set(),
             "dartree.base.cli": {"dartree.models.target"}, "dartree.training.tools.campaign": set(),
             "dartree.kernels.gru": {"dartree.decode.eval"}, "dartree.decode.eval": {"dartree.decode.harness.eval"},
             "dartree.convert.registry": {"dartree.speculator"}, "dartree.speculator": {"dartree.decode.harness.eval"}}
    # the location rule: a module under a programs folder and a thin script rank as programs, wherever they sit
    assert back_edges(graph, frozenset({"dartree.decode.eval"})) == [
        "dartree.base.cli -> dartree.models.target", "dartree.convert.registry -> dartree.speculator",
        "dartree.decode.generate -> dartree.decode.harness.session", "dartree.kernels.gru -> dartree.decode.eval",
        "dartree.models.target -> dartree.decode.trees", "dartree.training.data -> dartree.decode.generate"]
    assert _cycles(graph) == [["dartree.decode.trees", "dartree.decode.verify"]]
    thin = ast.parse('"""doc."""\n\nfrom dartree.x.tools.y import main\n\nif __name__ == "__main__":\n'
                     '    raise SystemExit(main())\n')
    fat = ast.parse('"""doc."""\n\nfrom dartree.x.tools.y import main\n\nX = 1\n\nif __name__ == "__main__":\n'
                    '    raise SystemExit(main())\n')
    assert is_thin_script(thin) and not is_thin_script(fat)
    assert layer("dartree.decode.eval", True) == ("decode", PROGRAM) and layer("dartree.decode.eval") == ("decode", 3)
    # the lazy-import rule: a function-level import counts as explained only with a `# lazy:` comment
    src = ("def f():\n    from dartree.models import target\n\n\ndef g():\n    # lazy: triton is optional\n"
           "    from dartree.kernels import gru\n    from dartree.kernels import frontier\n\n\n"
           "def h():\n    import dartree.kernels.gru  # lazy: a cycle\n    x = 1\n    from dartree.models import heads\n")
    assert unexplained_lazy_imports(src, "m") == ["m:2 from dartree.models import target",
                                                  "m:14 from dartree.models import heads"]
    # an import_module call with a literal name is an import: in the graph, and under the lazy-import rule
    src = ('import importlib\nX = importlib.import_module("dartree.models.families")\n\n\ndef f(name):\n'
           '    importlib.import_module(name)\n    return importlib.import_module("dartree.models.heads")\n')
    assert [(names, top) for _, names, top in _imports(ast.parse(src))] == [
        (["dartree.models.families"], True), (["dartree.models.heads"], False)]
    assert unexplained_lazy_imports(src, "m") == ['m:7 return importlib.import_module("dartree.models.heads")']


def test_no_file_cites_design_notes_outside_the_repository():
    # a clone stands on its own: the team's private design notes are not in it, so nothing cites them;
    # code cites the paper, the public code or a page of docs/
    import re
    import subprocess

    files = subprocess.run(["git", "ls-files"], cwd=REPO, capture_output=True, text=True, check=True).stdout.split()
    present = {Path(f).name for f in files}
    notes = re.compile(r"\b(ANCHORS|TESTING|DESIGN|PERFORMANCE|STYLE)\.md\b")
    scanned, cited = 0, []
    for f in files:
        if (f.endswith((".py", ".md", ".yaml", ".toml")) or f == "Makefile") and (REPO / f).is_file():
            scanned += 1
            text = (REPO / f).read_text(errors="replace")
            cited += [f"{f}: {m.group(0)}" for m in notes.finditer(text) if m.group(0) not in present]
    assert scanned > 100 and "design.md" in present
    assert cited == []


def _longest_functions(path: Path, limit: int) -> list[str]:
    """Every function (methods and nested functions included) of ``path`` over ``limit`` lines, with its length."""
    tree = ast.parse(path.read_text(), str(path))
    return [f"{path.relative_to(REPO)}:{node.lineno} {node.name} ({node.end_lineno - node.lineno + 1} lines)"
            for node in ast.walk(tree) if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))
            and node.end_lineno - node.lineno + 1 > limit]


def test_no_function_over_80_lines():
    # every module of the libraries, the base and the programs is named steps: no one function that holds a whole
    # run's state in closures (the eval session, the report, the trainer and the campaign included)
    files = [f for folder in ("base", "kernels", "models", "decode", "training", "convert")
             for f in sorted((REPO / folder).rglob("*.py"))]
    assert REPO / "decode" / "harness" / "eval.py" in files and REPO / "training" / "trainer.py" in files
    assert [line for f in files for line in _longest_functions(f, 80)] == []
    assert _longest_functions(REPO / "decode" / "harness" / "eval.py", 1)  # the walk sees the functions
