"""Weight, bias and recurrent parameter gradients are bitwise the same whatever the thread
count (issue 25): Numba's (NUMBA_NUM_THREADS, numba.set_num_threads), the BLAS's
(OPENBLAS_NUM_THREADS), over every cpu algorithm that applies (tests/determinism_child.py).

Each configuration runs in a child process. The first child only fills Numba's disk cache:
a parallel kernel freshly compiled in a process can round differently from the same kernel
loaded from the cache (docs/configuration.md, "Determinism"), so the comparisons are between
processes that all load it.
"""

import json
import os
import pathlib
import subprocess
import sys

import pytest

CHILD = pathlib.Path(__file__).with_name("determinism_child.py")

#: name: (environment changes, child arguments).
CONFIGURATIONS = {
    "NUMBA_NUM_THREADS=1": ({"NUMBA_NUM_THREADS": "1"}, []),
    "NUMBA_NUM_THREADS=2": ({"NUMBA_NUM_THREADS": "2"}, []),
    "NUMBA_NUM_THREADS=16": ({"NUMBA_NUM_THREADS": "16"}, []),
    "OPENBLAS_NUM_THREADS=1": ({"OPENBLAS_NUM_THREADS": "1"}, []),
    "numba.set_num_threads(1) under 2": ({"NUMBA_NUM_THREADS": "2"}, ["--set-num-threads-1"]),
}


def _child(environment: dict, arguments: list) -> subprocess.Popen:
    env = dict(os.environ, **environment)
    root = str(pathlib.Path(__file__).resolve().parents[1])
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [root, env.get("PYTHONPATH")]))
    return subprocess.Popen([sys.executable, str(CHILD), *arguments], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _answer(child: subprocess.Popen) -> dict:
    try:
        stdout, stderr = child.communicate(timeout=900)
    except subprocess.TimeoutExpired:
        child.kill()
        raise
    assert child.returncode == 0, stderr[-3000:]
    return json.loads(stdout)


@pytest.fixture(scope="module")
def digests() -> dict:
    _answer(_child({}, []))             # fills the kernel cache: see the module's docstring
    # The configurations then run side by side (their answers do not depend on timing).
    children = {name: _child(*setting) for name, setting in CONFIGURATIONS.items()}
    return {name: _answer(child) for name, child in children.items()}


def test_every_weight_gradient_algorithm_is_covered(digests):
    algorithms = {key.split()[-1] for key in next(iter(digests.values()))}
    assert {"gemm", "im2col", "implicit", "winograd", "direct"} <= algorithms


@pytest.mark.parametrize("name", list(CONFIGURATIONS)[1:])
def test_gradients_do_not_depend_on_the_thread_count(digests, name):
    first = list(CONFIGURATIONS)[0]
    differ = {key: (digests[first][key], digests[name][key]) for key in digests[first]
              if digests[first][key] != digests[name][key]}
    assert not differ, f"{name} against {first}: {sorted(differ)}"


def test_concurrent_callers_get_the_serial_bits():
    """Weight, bias and recurrent parameter gradients computed from 4 Python threads at once,
    beside forward and data-gradient calls, equal the same calls run one after another."""
    from concurrent.futures import ThreadPoolExecutor

    import numpy as np

    sys.path.insert(0, str(CHILD.parent))
    try:
        import determinism_child as child
    finally:
        sys.path.remove(str(CHILD.parent))
    import numbaconv as nc

    rng = np.random.default_rng(3)
    x = rng.standard_normal((4, 32, 20, 20), dtype=np.float32)
    w = rng.standard_normal((32, 32, 3, 3), dtype=np.float32)

    def forward_and_data_gradient():
        y = nc.conv(x, w, padding=1)
        return nc.conv_backward_data(y, w, x.shape, padding=1)

    serial = child.gradients()
    with ThreadPoolExecutor(4) as pool:
        noise = [pool.submit(forward_and_data_gradient) for _ in range(4)]
        results = [pool.submit(child.gradients) for _ in range(3)]
        for future in noise:
            future.result()
        concurrent = [future.result() for future in results]
    for result in concurrent:
        differ = sorted(key for key in serial if result[key] != serial[key])
        assert not differ, f"concurrent calls differ from serial ones: {differ}"
