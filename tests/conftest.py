import os
import subprocess
import sys

# Tests import helper modules (torch_oracle) from this folder.
sys.path.insert(0, os.path.dirname(__file__))

import numpy as np  # noqa: E402
import pytest  # noqa: E402

from numbaconv.testing import CASES  # noqa: E402


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


@pytest.fixture
def run_under_boundscheck():
    """A function running test code in a fresh interpreter compiled with NUMBA_BOUNDSCHECK=1
    (the cpu kernels' out-of-bounds check)."""
    return _run_under_boundscheck


def _run_under_boundscheck(code: str) -> None:
    """Run ``code`` (with this folder importable) in a fresh interpreter whose kernels are
    compiled with NUMBA_BOUNDSCHECK=1 (and no disk cache): it must finish without error."""
    env = dict(os.environ, NUMBA_BOUNDSCHECK="1", NUMBACONV_JIT_CACHE="0")
    script = (f"import sys; sys.path.insert(0, {os.path.dirname(__file__)!r})\n{code}"
              "print('boundscheck ok')\n")
    result = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True,
                            text=True, timeout=900)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "boundscheck ok" in result.stdout
