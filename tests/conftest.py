import os

import pytest

# Tests never reach the hub: everything they load is built here or shipped with the project.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# One process per run unless a test asks for more: fakes and monkeypatches live in this process only.
os.environ.setdefault("CCQ_EVAL_WORKERS", "1")
# Under pytest-xdist each worker takes its share of the cores for torch's CPU references, not all of them.
if os.environ.get("PYTEST_XDIST_WORKER_COUNT"):
    import torch

    torch.set_num_threads(max(1, (os.cpu_count() or 1) // int(os.environ["PYTEST_XDIST_WORKER_COUNT"])))


@pytest.fixture(autouse=True, scope="session")
def _torch_environment_report_once():
    """lm-eval's simple_evaluate adds torch's environment report (torch.utils.collect_env: pip, nvidia-smi,
    lscpu and more in subprocesses, about 2 s a call) to every results dict; it does not change while the
    tests run, so each test process takes it once (ccq-eval's own runs take it once per process already,
    ccq_eval/harness/lm_eval_call.py). Processes the tests start take their own."""
    import functools

    from torch.utils import collect_env

    original = collect_env.get_pretty_env_info
    collect_env.get_pretty_env_info = functools.cache(original)
    yield
    collect_env.get_pretty_env_info = original


@pytest.fixture(autouse=True)
def _gpu_tests_autotune_few_candidates(request):
    """GPU tests run fla's kernels with a few autotuning candidates each (tests/autotune_cap.py), so that a
    fresh GPU machine does not spend many minutes tuning every candidate of every kernel."""
    if request.node.get_closest_marker("gpu") is None:
        yield
        return
    from autotune_cap import capped_autotuning

    with capped_autotuning():
        yield


@pytest.fixture
def unreachable_hub(monkeypatch):
    """The hub allowed (no offline or proxy variable) but unreachable: HF_ENDPOINT is a local port nothing
    listens on, so ccq-eval's reachability probe is refused at once; its cached answer is cleared around."""
    import socket

    from ccq_eval.harness import fingerprints

    with socket.socket() as closed:
        closed.bind(("127.0.0.1", 0))
        port = closed.getsockname()[1]
    for name in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE", *fingerprints._PROXY_VARIABLES):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("HF_ENDPOINT", f"http://127.0.0.1:{port}")
    fingerprints.hub_reachable.cache_clear()
    yield
    fingerprints.hub_reachable.cache_clear()


def pytest_configure(config):
    """Under `--dist loadfile` (the README's test command), pytest-xdist hands out whole modules in
    collection order rather than ordered by their number of tests, so that the modules with slow tests,
    collected first below, start first."""
    if getattr(config.option, "dist", "no") in ("loadfile", "loadscope"):
        config.option.loadscopereorder = False


def pytest_collection_modifyitems(config, items):
    """Tests marked gpu_long (minutes each) go first, then the modules that hold a test marked slow (each
    module's tests in their own order): pytest-xdist hands out tests (or, with --dist loadfile, modules) in
    collection order, so the long ones start on the workers at once while the short ones fill in around
    them. `pytest -m gpu -n 12` takes about as long as its longest test rather than that test after the
    rest, and `pytest -n 2 --dist loadfile` ends on short modules rather than on a long one."""
    slow_modules = {item.path for item in items if item.get_closest_marker("slow") is not None}
    items.sort(key=lambda item: (item.get_closest_marker("gpu_long") is None, item.path not in slow_modules))
