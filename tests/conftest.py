import os
import sys

# Tests import helper modules (torch_oracle) from this folder.
sys.path.insert(0, os.path.dirname(__file__))

import numpy as np  # noqa: E402
import pytest  # noqa: E402

from numbaconv.testing import CASES  # noqa: E402

import background  # noqa: E402


@pytest.fixture(params=CASES, ids=[c.name for c in CASES])
def conv_case(request):
    return request.param


@pytest.fixture(params=["channels_first", "channels_last"])
def layout(request):
    return request.param


@pytest.fixture
def rng():
    return np.random.default_rng(1234)


@pytest.fixture
def local_cluster():
    """A distributed.LocalCluster of 2 one-thread worker processes on loopback (skipped
    where distributed is missing or the cluster cannot start)."""
    distributed = pytest.importorskip("distributed")
    try:
        cluster = distributed.LocalCluster(n_workers=2, processes=True, threads_per_worker=1,
                                           host="127.0.0.1", dashboard_address=None,
                                           silence_logs=50)
    except Exception as error:  # pragma: no cover - depends on the machine
        pytest.skip(f"a LocalCluster with 2 worker processes could not start on loopback "
                    f"here: {type(error).__name__}: {error}")
    with cluster:
        yield cluster


# Under Numba's CUDA simulator (tests/test_cuda.py runs the simulator files so): shared
# arrays made safe to create from the block's threads, a shorter GIL switch interval.
if os.environ.get("NUMBA_ENABLE_CUDASIM", "0") not in ("", "0"):
    import simulator
    simulator.prepare()

# The suite runs beside background.py's subprocesses, which keep a core busy: its calls keep
# their threads rather than adapt to the load (tests of the adaptation set this themselves).
os.environ["NUMBACONV_ADAPT_THREADS"] = "0"


def pytest_configure(config):
    config.addinivalue_line("markers", "background(name): the test waits for the result of "
                            "tests/background.py's command of that name")


def _background_names(item) -> list:
    return [mark.args[0] for mark in item.iter_markers("background")]


@pytest.hookimpl(trylast=True)
def pytest_collection_modifyitems(session, config, items):
    """The tests that wait for a background command go last, so that the commands run
    beside the rest of the suite (see tests/background.py); the test files that a collected
    command runs itself are left out."""
    waiting = {item for item in items if _background_names(item)}
    replaced = {path for item in waiting for name in _background_names(item)
                for path in background.COMMANDS[name].replaces
                if background.COMMANDS[name].enabled}
    left_out = [item for item in items if str(item.path) in replaced]
    if left_out:
        config.hook.pytest_deselected(items=left_out)
    items[:] = [item for item in items if item not in waiting and item not in left_out] + \
        [item for item in items if item in waiting]


def pytest_collection_finish(session):
    if session.config.option.collectonly:
        return
    names = list(dict.fromkeys(name for item in session.items
                               for name in _background_names(item)))
    if names:
        background.start(names)


def pytest_terminal_summary(terminalreporter):
    lines = background.report()
    if lines:
        terminalreporter.section("background commands (wall time)")
        for line in lines:
            terminalreporter.write_line(line)


def pytest_sessionfinish(session, exitstatus):
    background.stop()
