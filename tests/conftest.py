import os
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
