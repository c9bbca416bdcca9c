"""Rules the production code (ccq_eval/, tasks/, the top-level cli.py; not tests/, scripts/ or benchmarks/)
keeps, checked on its source:

- it never changes an object of lm-eval, tqdm, transformers, triton or fla, and never uses a patching
  tool (unittest.mock, mock, pytest's MonkeyPatch): ccq-eval steers its dependencies through their public
  switches, logging configuration and arguments. What counts as a library object and as a change is
  defined in tests/library_patching.py, the way tests/model/test_fla_untouched.py defines fla untouched:
  the models ccq-eval builds or loads (and every other object made by calling a library) are its own;
  the libraries' modules, classes, functions, module dicts and loggers are not;
- no module is over MODULE_LINES lines and no function over FUNCTION_LINES (decorators excluded,
  docstring included): past those sizes the code divides into parts.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
from library_patching import library_changes

ROOT = Path(__file__).resolve().parents[1]
MODULE_LINES = 500
FUNCTION_LINES = 80


def production_files(root: Path = ROOT) -> list[Path]:
    files = [path for base in ("ccq_eval", "tasks") for path in sorted((root / base).rglob("*.py"))
             if "__pycache__" not in path.parts]
    return files + ([root / "cli.py"] if (root / "cli.py").exists() else [])


def module_name(path: Path, root: Path = ROOT) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    if parts[0] == "tasks":  # installed as ccq_eval.tasks
        parts.insert(0, "ccq_eval")
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


FILES = production_files()


# --- no library object changed, no patching tool ------------------------------------------------------


def changes_in(sources: dict[str, str]) -> list[str]:
    return [str(finding) for finding in library_changes(sources)]


def test_production_code_changes_no_library_object():
    sources = {module_name(path): path.read_text(encoding="utf-8") for path in FILES}
    packages = frozenset(module_name(path) for path in FILES if path.name == "__init__.py")
    assert len(sources) > 40 and "ccq_eval.model.modeling_ccq" in sources
    findings = [str(finding) for finding in library_changes(sources, packages)]
    assert not findings, ("production code changes library objects or uses a patching tool (use the "
                          "library's public switches, logging configuration or arguments):\n" + "\n".join(findings))


# Each case: code that changes a library object, or uses a patching tool; the guard must name the line
# marked `# <-` (the last line where none is marked).
CHANGES = {
    "a class's method": "import tqdm.std\ntqdm.std.tqdm.__init__ = init\n",
    "a module found in sys.modules": (
        "import sys\n\ndef quiet():\n    std = sys.modules.get('tqdm.std')\n    std.tqdm.__init__ = None\n"),
    "lm-eval's logger": "import logging\nlogging.getLogger('lm_eval').handlers = []\n",
    "loggers named in a loop": (
        "import logging\nfor name in ('ccq_eval', 'lm_eval'):\n    logger = logging.getLogger(name)\n"
        "    logger.propagate = False\n"),
    "a logger of a sub-package": "import logging\nlog = logging.getLogger(f'transformers.{x}')\nlog.disabled = True\n",
    "setattr on a module": "from lm_eval import evaluator\nsetattr(evaluator, 'get_git_commit_hash', str)\n",
    "object.__setattr__ on a class": (
        "from fla.models import GLAForCausalLM\nobject.__setattr__(GLAForCausalLM, 'forward', f)\n"),
    "an entry of a module dict": "from fla.modules.activations import ACT2FN\nACT2FN['swish'] = f\n",
    "a del": "import fla.layers.gla\ndel fla.layers.gla.chunk_gla\n",
    "an augmented assignment": "import triton\ntriton.runtime.driver.count += 1\n",
    "a module from import_module": "import importlib\nops = importlib.import_module('fla.ops')\nops.chunk_gla = f\n",
    "a module by a name not known": "import importlib\nops = importlib.import_module(name)\nops.chunk_gla = f\n",
    "a mutating method": "import logging\nlogging.getLogger('lm_eval').handlers.clear()\n",
    "a class dict": "from triton.runtime.autotuner import Autotuner\nvars(Autotuner).pop('prune_configs')\n",
    "sys.modules": "import sys\nsys.modules['fla.ops'] = stand_in\n",
    "a helper's parameter": (
        "import logging\n\ndef mute(logger):\n    logger.disabled = True  # <-\n\n"
        "mute(logging.getLogger('lm_eval'))\n"),
    "an attribute of self": (
        "import logging\n\nclass Quiet:\n    def __init__(self):\n        self.log = logging.getLogger('tqdm')\n\n"
        "    def on(self):\n        self.log.disabled = True\n"),
    "objects collected from sys.modules": (
        "import sys\n\ndef tuners():\n    found = {}\n    for name, module in list(sys.modules.items()):\n"
        "        for value in vars(module).values():\n            found[id(value)] = value\n"
        "    return list(found.values())\n\nfor tuner in tuners():\n    tuner.cache = {}\n"),
    "unittest.mock imported": "import unittest.mock\n",
    "mock from unittest": "from unittest import mock\n",
    "unittest.mock used": "import unittest\n\ndef f():\n    return unittest.mock.patch('x')\n",
    "MonkeyPatch": "import pytest\n\ndef f():\n    return pytest.MonkeyPatch()\n",
}


@pytest.mark.parametrize("source", CHANGES.values(), ids=CHANGES.keys())
def test_guard_finds_each_kind_of_change(source):
    findings = changes_in({"ccq_eval.example": source})
    assert findings, "the guard missed it"
    lines = source.rstrip("\n").splitlines()
    line = next((number for number, text in enumerate(lines, 1) if text.endswith("# <-")), len(lines))
    assert any(finding.startswith(f"ccq_eval.example:{line}:") for finding in findings), findings


def test_guard_follows_functions_across_modules():
    sources = {"ccq_eval.quiet": "import logging\n\ndef lm_eval_logger():\n    return logging.getLogger('lm_eval')\n",
               "ccq_eval.cli": "from ccq_eval.quiet import lm_eval_logger\n\nlm_eval_logger().propagate = False\n"}
    assert changes_in(sources) == ["ccq_eval.cli:3: assigns lm_eval_logger().propagate, part of a library object"]


# Code that changes only objects of its own: the guard must stay silent.
OWN_OBJECTS = {
    "a model it builds": (
        "from fla.models import GLAForCausalLM\nmodel = GLAForCausalLM(config)\nmodel.foo = 1\n"
        "model.config.use_cache = False\n"),
    "its subclass's instances": (
        "from fla.models import GLAForCausalLM\n\nclass Ours(GLAForCausalLM):\n    def __init__(self, config):\n"
        "        super().__init__(config)\n        self.ccq = True\n"),
    "the modules of a model it was given": (
        "from fla.models import GLAForCausalLM\n\ndef use(model):\n    for module in model.modules():\n"
        "        module.__class__ = Backend\n        setattr(module, 'act', f)\n\nuse(GLAForCausalLM(config))\n"),
    "its own loggers": (
        "import logging\nlogger = logging.getLogger(__name__)\nlogger.handlers = []\n"
        "logging.getLogger('ccq_eval').propagate = False\n"),
    "a container of its own holding library objects": (
        "import sys\nfound = {}\nfor module in list(sys.modules.values()):\n    found[id(module)] = module\n"
        "found.clear()\n"),
    "what a library call returned": (
        "from lm_eval import evaluator\nresults = evaluator.simple_evaluate(model=m)\nresults['x'] = 1\n"),
    "public switches and logging calls": (
        "import logging\nimport transformers\nlogging.getLogger('lm_eval').setLevel('ERROR')\n"
        "transformers.utils.logging.disable_progress_bar()\n"),
    "another package in sys.modules": "import sys\nsys.modules['torch'].get_num_threads()\n",
    "a progress bar it made": "from tqdm import tqdm\nbar = tqdm(total=3)\nbar.disable = True\nbar.update(1)\n",
}


@pytest.mark.parametrize("source", OWN_OBJECTS.values(), ids=OWN_OBJECTS.keys())
def test_guard_leaves_own_objects_alone(source):
    assert changes_in({"ccq_eval.example": source}) == []


# --- sizes --------------------------------------------------------------------------------------------


def long_functions(source: str, limit: int = FUNCTION_LINES) -> list[tuple[str, int, int]]:
    """(qualified name, first line, lines) of each function over `limit` lines, from `def` to its end."""
    found = []

    def visit(node: ast.AST, prefix: str) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                name = f"{prefix}{child.name}"
                if not isinstance(child, ast.ClassDef):
                    lines = child.end_lineno - child.lineno + 1
                    if lines > limit:
                        found.append((name, child.lineno, lines))
                visit(child, name + ".")
            else:
                visit(child, prefix)

    visit(ast.parse(source), "")
    return found


def test_no_module_over_the_limit():
    assert FILES
    over = [f"{path.relative_to(ROOT)}: {lines} lines" for path in FILES
            if (lines := len(path.read_text(encoding="utf-8").splitlines())) > MODULE_LINES]
    assert not over, f"modules over {MODULE_LINES} lines (divide them where the code divides):\n" + "\n".join(over)


def test_no_function_over_the_limit():
    over = [f"{path.relative_to(ROOT)}:{line}: {name}, {lines} lines" for path in FILES
            for name, line, lines in long_functions(path.read_text(encoding="utf-8"))]
    assert not over, f"functions over {FUNCTION_LINES} lines:\n" + "\n".join(over)


def test_function_length_measure():
    body = "\n".join(f"    x = {i}" for i in range(FUNCTION_LINES - 1))
    exact = f"def fits():\n{body}\n"
    one_more = f"class C:\n    @property\n    def long(self):\n{body.replace('    ', '        ')}\n        y = 1\n"
    assert long_functions(exact) == []
    assert long_functions(one_more) == [("C.long", 3, FUNCTION_LINES + 1)]
