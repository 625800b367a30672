"""The import graph is layered one way: kernels < models < libraries (the decoding library, training, convert) <
tools (the evaluation harness, the command-line programs, the Python API), with no cycle anywhere.

Every ``import`` / ``from ... import`` of a ``dartree`` module counts, at module level or inside a function. A
library module imports lower layers and its own package; a tool imports anything below it and other tools.
"""

import ast
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PACKAGES = {"kernels": "kernels", "models": "models", "decode": "decode", "decode.harness": "decode/harness",
            "training": "training", "convert": "convert", "": "api"}  # dartree.<package> -> folder; api/ is dartree
# tools: the evaluation harness, the CLIs and programs that sit on several libraries, the Python API
TOOLS = {
    "decode": {"bench", "eval"},  # the harness's two commands; the harness itself is decode/harness/ (all tools)
    "training": {"train", "campaign", "campaign_train", "parity", "bench", "prepare", "burst"},
    "kernels": {"gpu_check"}, "models": set(), "convert": set(),
}
RANK = {"kernels": 0, "models": 1, "decode": 2, "training": 2, "convert": 2}


def _modules() -> dict[str, Path]:
    out = {}
    for pkg, folder in PACKAGES.items():
        for f in sorted((REPO / folder).glob("*.py")):
            name = "dartree" + (f".{pkg}" if pkg else "") + ("" if f.stem == "__init__" else f".{f.stem}")
            out[name] = f
    return out


def _package_and_rank(module: str) -> tuple[str, int]:
    """(package, layer) of ``dartree.PKG.NAME``: the package's rank, 3 for a tool and for the top-level API."""
    parts = module.split(".")[1:]
    if parts[:2] == ["decode", "harness"]:  # the evaluation harness: tools on the decoding library
        return "decode", 3
    if parts and parts[0] in RANK:
        pkg, stem = parts[0], parts[1] if len(parts) > 1 else "__init__"
    else:
        pkg, stem = "", parts[0] if parts else "__init__"
    return pkg, 3 if not pkg or stem in TOOLS[pkg] else RANK[pkg]


def import_graph() -> dict[str, set[str]]:
    """{module: the dartree modules it imports}, from the source of every module (module level and functions)."""
    mods = _modules()
    graph = {m: set() for m in mods}
    for m, f in mods.items():
        for node in ast.walk(ast.parse(f.read_text(), str(f))):
            names = []
            if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("dartree"):
                names = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
            elif isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            graph[m].update(n for n in names if n in mods and n != m)
    return graph


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


def back_edges(graph: dict[str, set[str]]) -> list[str]:
    """Imports that go up a layer, or sideways from one library package into another."""
    bad = []
    for a, targets in graph.items():
        pa, ra = _package_and_rank(a)
        for b in targets:
            pb, rb = _package_and_rank(b)
            if ra == 3:
                ok = pb != "" or pa == ""  # a tool may use anything but the top-level API
            else:
                ok = rb < ra or (rb == ra and pa == pb)
            if not ok:
                bad.append(f"{a} -> {b}")
    return sorted(bad)


def test_the_import_graph_has_no_back_edge_and_no_cycle():
    graph = import_graph()
    assert len(graph) > 60 and graph["dartree.decode.generate"]  # the walk found the modules and their imports
    assert back_edges(graph) == []
    assert _cycles(graph) == []


def test_the_checks_catch_a_back_edge_and_a_cycle():
    graph = {"dartree.models.target": {"dartree.decode.trees"}, "dartree.decode.trees": {"dartree.decode.verify"},
             "dartree.decode.verify": {"dartree.decode.trees"}, "dartree.decode.eval": {"dartree.training.data"},
             "dartree.training.data": {"dartree.decode.generate"}, "dartree.decode.generate": set()}
    assert back_edges(graph) == ["dartree.models.target -> dartree.decode.trees",
                                 "dartree.training.data -> dartree.decode.generate"]
    assert _cycles(graph) == [["dartree.decode.trees", "dartree.decode.verify"]]


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


def test_the_eval_cli_and_the_trainer_have_no_function_over_80_lines():
    # the evaluation CLI is named stages (a session, a per-prompt decode, pure report building and rendering) and
    # the trainer stays so: no one function that holds a whole run's state in closures
    harness = REPO / "decode" / "harness"
    files = [REPO / "decode" / "eval.py", harness / "session.py", harness / "report.py",
             REPO / "training" / "trainer.py", REPO / "training" / "train.py"]
    assert all(f.is_file() for f in files)
    assert [line for f in files for line in _longest_functions(f, 80)] == []
    assert _longest_functions(REPO / "decode" / "eval.py", 1)  # the walk sees the functions
