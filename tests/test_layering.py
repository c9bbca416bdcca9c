"""The import graph keeps its floors: no import runs from a lower floor to a higher one, no modules import
each other in a circle, and the analysis reads results without the model stack.

The floors, bottom to top (docs/layout.md describes what each part holds):

1. foundation: the package itself, `errors`, `atomic_io`, `task_families`, `logs`: plain Python that
   every other part may use;
2. model and data: `model/` (the CCQ operator, the model classes, kernels, fla's CPU backend) and `data/`
   (the embedded corpora);
3. tasks: the lm-eval task folders (`tasks/`, installed as `ccq_eval.tasks`), which build prompts with
   the model's tokenizer and the corpora;
4. harness: the lm-eval adapter, the runner and the results store;
5. analysis and inspection: they read what the harness stored, or drive models the way it does;
6. command line: `ccq_eval.cli`, `python -m ccq_eval` and the checkout's top-level cli.py.

Every import counts, the lazy ones inside functions too: a lazy import is still an arrow between two
modules, it only runs later. A module may import modules of its own floor and of the floors below it.
"""

from __future__ import annotations

import ast
from collections.abc import Iterable
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

FLOORS: list[tuple[str, tuple[str, ...]]] = [
    ("foundation", ("ccq_eval", "ccq_eval.errors", "ccq_eval.atomic_io", "ccq_eval.task_families",
                    "ccq_eval.logs")),
    ("model and data", ("ccq_eval.model", "ccq_eval.data")),
    ("tasks", ("ccq_eval.tasks",)),
    ("harness", ("ccq_eval.harness",)),
    ("analysis and inspection", ("ccq_eval.analysis", "ccq_eval.inspection")),
    ("command line", ("ccq_eval.cli", "ccq_eval.__main__", "cli")),
]
# Packages whose names are a floor of their own only as themselves (their subpackages have other floors).
EXACT_ONLY = {"ccq_eval"}
# What reading results must never load: the model stack and lm-eval (`ccq-eval table`, `compare`,
# `figures` and `report` run where none of them is installed or usable).
MODEL_STACK = {"torch", "fla", "triton", "transformers", "lm_eval", "accelerate"}


def project_modules(root: Path = ROOT) -> dict[str, Path]:
    """Module name -> file for the package (ccq_eval/), the task folders (tasks/, as ccq_eval.tasks) and
    the top-level cli.py."""
    modules: dict[str, Path] = {}
    for base, prefix in ((root / "ccq_eval", ("ccq_eval",)), (root / "tasks", ("ccq_eval", "tasks"))):
        for path in sorted(base.rglob("*.py")):
            if "__pycache__" in path.parts:
                continue
            parts = list(prefix) + list(path.relative_to(base).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            modules[".".join(parts)] = path
    if (root / "cli.py").exists():
        modules["cli"] = root / "cli.py"
    return modules


def _is_package(path: Path) -> bool:
    return path.name == "__init__.py"


def _nodes(tree: ast.AST, at_import_only: bool):
    """The nodes of `tree`; with at_import_only, not those inside functions (which run when called)."""
    for node in ast.iter_child_nodes(tree):
        yield node
        if not (at_import_only and isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda))):
            yield from _nodes(node, at_import_only)


def imports_of(name: str, path: Path, modules: dict[str, Path],
               at_import_only: bool = False) -> tuple[set[str], set[str]]:
    """(project modules, top-level names of other packages) that the module `name` imports anywhere in
    its code, or with at_import_only only where importing it runs them (outside functions).
    `from package import name` is an import of the submodule where one of that name exists."""
    project: set[str] = set()
    external: set[str] = set()
    package = name if _is_package(path) else name.rpartition(".")[0]

    def add(target: str) -> None:
        if target in modules:
            project.add(target)
        elif target.split(".")[0] in ("ccq_eval", "cli"):
            # a name inside a module (`import ccq_eval.x.y` where y is a function is not valid Python, but
            # an unknown submodule still points at its nearest existing parent)
            while target and target not in modules:
                target = target.rpartition(".")[0]
            if target:
                project.add(target)
        else:
            external.add(target.split(".")[0])

    for node in _nodes(ast.parse(path.read_text(encoding="utf-8")), at_import_only):
        if isinstance(node, ast.Import):
            for alias in node.names:
                add(alias.name)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[: len(base) - (node.level - 1)]
                module = ".".join(base + ([node.module] if node.module else []))
            else:
                module = node.module or ""
            if module == "tasks" or module.startswith("tasks."):  # the checkout's folder, installed as ccq_eval.tasks
                module = "ccq_eval." + module
            for alias in node.names:
                if f"{module}.{alias.name}" in modules:
                    add(f"{module}.{alias.name}")
                else:
                    add(module)
    project.discard(name)
    return project, external


def import_graph(root: Path = ROOT, at_import_only: bool = False) -> tuple[dict[str, set[str]], dict[str, set[str]]]:
    """(module -> project modules it imports, module -> other top-level packages it imports)."""
    modules = project_modules(root)
    graph, external = {}, {}
    for name, path in modules.items():
        graph[name], external[name] = imports_of(name, path, modules, at_import_only)
    return graph, external


def floor_of(module: str) -> int | None:
    """The index in FLOORS of the floor `module` is on (the longest matching prefix), None if none."""
    best: tuple[int, int] | None = None  # (prefix length, floor)
    for index, (_, prefixes) in enumerate(FLOORS):
        for prefix in prefixes:
            matches = module == prefix or (prefix not in EXACT_ONLY and module.startswith(prefix + "."))
            if matches and (best is None or len(prefix) > best[0]):
                best = (len(prefix), index)
    return None if best is None else best[1]


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    counter = 0
    for start in sorted(graph):
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = counter
        counter += 1
        stack.append(start)
        on_stack.add(start)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in graph:
                    continue
                if child not in index:
                    index[child] = low[child] = counter
                    counter += 1
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph[child]))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.append(sorted(component))
    return found


def reached(graph: dict[str, set[str]], starts: Iterable[str]) -> dict[str, str | None]:
    """Every project module that importing `starts` can load (their imports, transitively, with the
    package __init__ modules Python runs on the way to each of them), each with the module it was
    reached from (None for the starts)."""
    seen: dict[str, str | None] = {}
    todo: list[tuple[str, str | None]] = [(start, None) for start in sorted(starts)]
    while todo:
        module, via = todo.pop(0)
        if module in seen or module not in graph:
            continue
        seen[module] = via
        todo.extend((target, module) for target in sorted(graph[module]))
        parent = module.rpartition(".")[0]
        while parent:
            todo.append((parent, module))
            parent = parent.rpartition(".")[0]
    return seen


def chain(reached_from: dict[str, str | None], module: str) -> str:
    """`start -> ... -> module`, the way `reached` found `module`."""
    links = [module]
    while reached_from[links[-1]] is not None:
        links.append(reached_from[links[-1]])
    return " -> ".join(reversed(links))


GRAPH, EXTERNAL = import_graph()
GRAPH_AT_IMPORT, EXTERNAL_AT_IMPORT = import_graph(at_import_only=True)


def test_the_graph_is_read():
    """The checks below run on the real package: the graph has its parts and their arrows."""
    assert {"ccq_eval.cli", "ccq_eval.model.ccq", "ccq_eval.harness", "cli"} <= set(GRAPH) and len(GRAPH) > 40
    assert sum(len(targets) for targets in GRAPH.values()) > 50
    assert any(module.startswith("ccq_eval.tasks.") for module in GRAPH)


def test_every_module_has_a_floor():
    homeless = sorted(module for module in GRAPH if floor_of(module) is None)
    assert not homeless, f"modules on no floor of tests/test_layering.py's FLOORS (add them to one): {homeless}"


def test_no_import_runs_up_a_floor():
    upward = []
    for module, targets in sorted(GRAPH.items()):
        floor = floor_of(module)
        for target in sorted(targets):
            target_floor = floor_of(target)
            if floor is not None and target_floor is not None and target_floor > floor:
                upward.append(f"{module} ({FLOORS[floor][0]}) imports {target} ({FLOORS[target_floor][0]})")
    assert not upward, "imports from a lower floor to a higher one:\n" + "\n".join(upward)


def test_no_import_cycle():
    circles = cycles(GRAPH)
    assert not circles, "modules that import each other in a circle:\n" + "\n".join(
        " <-> ".join(component) for component in circles)


def test_reading_results_loads_no_model_stack():
    """Reading results loads none of torch, fla, triton, transformers, lm-eval and accelerate: not the
    analysis modules' own imports (lazy ones included: they run when the analysis does), nor what the
    modules they import load when imported (their functions' lazy imports run only if called)."""
    analysis = {module for module in GRAPH if module == "ccq_eval.analysis" or module.startswith("ccq_eval.analysis.")}
    assert analysis
    graph = {module: GRAPH[module] if module in analysis else GRAPH_AT_IMPORT[module] for module in GRAPH}
    external = {module: EXTERNAL[module] if module in analysis else EXTERNAL_AT_IMPORT[module] for module in GRAPH}
    offenders = []
    reached_from = reached(graph, analysis)
    for module in sorted(reached_from):
        heavy = sorted(external[module] & MODEL_STACK)
        if heavy:
            offenders.append(f"{chain(reached_from, module)}, which imports {', '.join(heavy)}")
    assert not offenders, "the analysis reaches modules that import the model stack:\n" + "\n".join(offenders)


# The checks themselves, on small graphs: each must be able to fail.


def test_cycle_finder_on_small_graphs():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert cycles({"a": {"b"}, "b": set(), "c": {"b"}}) == []
    assert sorted(cycles({"a": {"b"}, "b": {"a"}, "c": {"d"}, "d": {"c"}})) == [["a", "b"], ["c", "d"]]


def test_floors_of_sample_modules():
    assert floor_of("ccq_eval") == 0 and floor_of("ccq_eval.errors") == 0
    assert floor_of("ccq_eval.model.kernels.autotune") == 1
    assert floor_of("ccq_eval.tasks.s_niah.utils") == 2
    assert floor_of("ccq_eval.harness.runner") == 3
    assert floor_of("ccq_eval.analysis.report") == floor_of("ccq_eval.inspection.run") == 4
    assert floor_of("ccq_eval.cli.run") == floor_of("cli") == 5
    assert floor_of("ccq_eval.somewhere_new") is None  # a new top-level module must be given a floor


def test_imports_resolve_relative_and_submodule_forms(tmp_path):
    package = tmp_path / "ccq_eval"
    (package / "harness").mkdir(parents=True)
    (package / "__init__.py").write_text("")
    (package / "errors.py").write_text("")
    (package / "harness" / "__init__.py").write_text("")
    (package / "harness" / "store.py").write_text("from .. import errors\nimport torch.nn\n")
    (package / "harness" / "runner.py").write_text(
        "def run():\n    from ccq_eval.harness import store\n    from ccq_eval.errors import UserError\n")
    graph, external = import_graph(tmp_path)
    assert import_graph(tmp_path, at_import_only=True)[0]["ccq_eval.harness.runner"] == set()
    assert graph["ccq_eval.harness.store"] == {"ccq_eval.errors"}
    assert external["ccq_eval.harness.store"] == {"torch"}
    assert graph["ccq_eval.harness.runner"] == {"ccq_eval.harness.store", "ccq_eval.errors"}
    reached_from = reached(graph, ["ccq_eval.harness.runner"])
    assert set(reached_from) == {
        "ccq_eval.harness.runner", "ccq_eval.harness.store", "ccq_eval.errors", "ccq_eval.harness", "ccq_eval"}
    assert chain(reached_from, "ccq_eval.errors") == "ccq_eval.harness.runner -> ccq_eval.errors"
