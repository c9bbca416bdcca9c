"""`ccq-eval run` in a separate process with the fake world of test_cli_run (no model): the
worker processes of tests/cli/test_reliability.py.

    python tests/cli/fake_worker.py WORKDIR LOG DELAY ARGS...

WORKDIR holds the fake tasks (written by `write_tasks`) and is the working directory; every request
the fake model answers is appended to LOG as "<model>\t<task>\t<prompt>" (one write per line, so
workers can share the file); DELAY seconds pass per request, so that workers overlap.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from test_cli_run import REGISTRY, TASK_NAME, TASK_UTILS, TASK_YAML, FakeCatalog, FakeLM

# Two S-NIAH-like tasks (the test task and a copy under another name): a grid of models x tasks.
TASKS = (TASK_NAME, f"{TASK_NAME}_b")


def write_tasks(folder: Path) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "fake_utils.py").write_text(TASK_UTILS)
    for name in TASKS:
        (folder / f"{name}.yaml").write_text(TASK_YAML.replace(f"task: {TASK_NAME}", f"task: {name}"))


class GridCatalog(FakeCatalog):
    def aliases(self):
        return {"grid": "two fake tasks"} | {name: "a fake task" for name in TASKS}

    def resolve(self, name):
        if name == "grid":
            return list(TASKS)
        if name in TASKS:
            return [name]
        raise KeyError(name)


class LoggedLM(FakeLM):
    def __init__(self, name: str, log: Path, delay: float):
        super().__init__(name, [])
        self.log, self.delay = log, delay

    def generate_until(self, requests, disable_tqdm=False):
        answers = []
        for request in requests:
            time.sleep(self.delay)
            answers += super().generate_until([request])
            with open(self.log, "a", encoding="utf-8") as handle:
                handle.write(f"{self.name}\t{request.task_name}\t{request.args[0]}\n")
        return answers


def main(workdir: Path, log: Path, delay: float, args: list[str]) -> int:
    from ccq_eval import cli
    from ccq_eval.harness import plan as run_plan
    from ccq_eval.harness import runner

    catalog = GridCatalog(workdir / "tasks")
    run_plan.load_model_registry = lambda *a, **k: dict(REGISTRY)
    run_plan.default_task_catalog = lambda: catalog
    runner.default_evaluator = lambda: runner.LmEvalUnitEvaluator(
        load_model=lambda source, device, dtype: (Path(source).name, None),
        make_adapter=lambda model, *rest: LoggedLM(model, log, delay),
        task_catalog=catalog,
    )
    return cli.app(args, prog_name="ccq-eval")  # exits with the command's status


if __name__ == "__main__":
    import os

    os.chdir(sys.argv[1])
    sys.exit(main(Path(sys.argv[1]), Path(sys.argv[2]).resolve(), float(sys.argv[3]), sys.argv[4:]))
