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
