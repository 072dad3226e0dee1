"""The ``cuda`` backend (twin of test_cpu.py): registration and availability here, and its
kernels under Numba's simulator in a subprocess (tests/test_cuda_sim.py), since the simulator
must be switched on before Numba is first imported. Compilation for real GPUs is in
tests/test_cuda_compile.py.
"""

import importlib.util
import os
import subprocess
import sys

import pytest

import numbaconv as nc

HERE = os.path.dirname(os.path.abspath(__file__))
needs_numba_cuda = pytest.mark.skipif(importlib.util.find_spec("numba_cuda") is None,
                                      reason="numba-cuda is not installed (the cuda extra)")


def test_cuda_backend_is_registered():
    info = {b.name: b for b in nc.backends()}["cuda"]
    assert (info.device, info.priority) == ("cuda", 100)
    if not info.available:
        assert "numba-cuda" in info.reason or "CUDA driver" in info.reason


def test_creating_the_backend_touches_no_gpu():
    code = ("import sys, numbaconv as nc; from numbaconv import dispatch; "
            "b = dispatch.get_backend('cuda'); "
            "assert b.name == 'cuda' and 'numba.cuda' not in sys.modules, sorted(sys.modules)")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


@needs_numba_cuda
def test_kernels_under_the_simulator():
    """Every op and algorithm on tiny cases, small tiles so last blocks are partial: the
    GEMM tile is 8x16 outputs, step 8, 2x2 a thread (32 threads, two channels-last columns
    a thread, as the full-size tiles have)."""
    env = dict(os.environ, NUMBA_ENABLE_CUDASIM="1", NUMBACONV_CUDA_TILE="4,8,4",
               NUMBACONV_CUDA_THREADS="32", NUMBACONV_CUDA_GEMM_TILE="8,16,8,2,2")
    done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-x", "-p",
                           "no:cacheprovider", os.path.join(HERE, "test_cuda_sim.py")],
                          env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-6000:] + done.stderr[-3000:]
    assert " passed" in done.stdout and "skipped" not in done.stdout.splitlines()[-1]


@needs_numba_cuda
def test_rnn_kernels_under_the_simulator():
    """The recurrent ops (tests/test_cuda_rnn_sim.py) on T=3, N=3, I=4, H=5 with small tiles
    and blocks, so that every GEMM tile and element-wise block is partly filled."""
    env = dict(os.environ, NUMBA_ENABLE_CUDASIM="1", NUMBACONV_CUDA_TILE="4,8,4",
               NUMBACONV_CUDA_THREADS="32")
    done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-x", "-p",
                           "no:cacheprovider", os.path.join(HERE, "test_cuda_rnn_sim.py")],
                          env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-6000:] + done.stderr[-3000:]
    assert " passed" in done.stdout and "skipped" not in done.stdout.splitlines()[-1]
