"""The ``cuda`` backend (twin of test_cpu.py): registration and availability here, and its
kernels under Numba's simulator in a subprocess (tests/test_cuda_sim.py), since the simulator
must be switched on before Numba is first imported. Compilation for real GPUs is in
tests/test_cuda_compile.py and tests/test_cuda_machine_code.py, which a whole session runs
in a subprocess beside the rest too (see COMPILER).
"""

import importlib.util
import os
import subprocess
import sys

import pytest

import numbaconv as nc

import background

HERE = os.path.dirname(os.path.abspath(__file__))
needs_numba_cuda = pytest.mark.skipif(importlib.util.find_spec("numba_cuda") is None,
                                      reason="numba-cuda is not installed (the cuda extra)")


def test_cuda_backend_is_registered():
    info = {b.name: b for b in nc.backends()}["cuda"]
    assert (info.device, info.priority) == ("cuda", 100)
    if not info.available:
        assert "numba-cuda" in info.reason or "CUDA driver" in info.reason


def test_numpy_without_row_stack_is_named_for_old_numba_cuda():
    """numba-cuda 0.30.4 compiles no kernel under NumPy 2.5 (seen on an H200, 2026-11-27:
    AttributeError on np.row_stack at the first kernel): the backend says so up front."""
    import types

    from numbaconv.cuda import _numpy_problem
    new_numpy = types.SimpleNamespace(__version__="2.5.2")
    reason = _numpy_problem(new_numpy, "0.30.4")
    assert "numba-cuda 0.30.4" in reason and "NumPy 2.5.2" in reason and "numpy<2.5" in reason
    assert _numpy_problem(new_numpy, "0.31.0") is None
    old_numpy = types.SimpleNamespace(__version__="2.4.6", row_stack=None)
    assert _numpy_problem(old_numpy, "0.30.4") is None


def test_persistent_is_offered_for_the_forward_and_data_gradient():
    """The persistent forward and data gradient (tests/test_cuda_rnn_sim.py) are offered,
    with and without projection, and not chosen."""
    from numbaconv import dispatch
    from numbaconv.rnn_problem import RNNProblem
    backend = dispatch.get_backend("cuda")
    for cfg in (nc.RNNConfig("lstm", 4, 5), nc.RNNConfig("lstm", 4, 5, proj_size=2)):
        for op in ("rnn_forward", "rnn_backward_data", "rnn_backward_weights"):
            problem = RNNProblem(op, cfg, 3, 2, "float32", "cuda", True)
            want = ("fused", "persistent") if op != "rnn_backward_weights" else ("fused",)
            assert backend.algorithms(op, problem) == want, (op, cfg)
            assert backend.choose(op, problem)[0] == "fused"


def test_creating_the_backend_touches_no_gpu():
    code = ("import sys, numbaconv as nc; from numbaconv import dispatch; "
            "b = dispatch.get_backend('cuda'); "
            "assert b.name == 'cuda' and 'numba.cuda' not in sys.modules, sorted(sys.modules)")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


#: The simulator runs, each a pytest run of one test file in a subprocess (the simulator must
#: be on before Numba is first imported), beside the rest of the suite (tests/background.py):
#: each keeps one core busy for minutes of pure-Python simulation. Not started where
#: numba-cuda is missing.
SIMULATOR_RUNS = {
    # Every op and algorithm on tiny cases, small tiles so last blocks are partial: the GEMM
    # tile is 8x16 outputs, step 8, 2x2 a thread (32 threads, two channels-last columns a
    # thread, as the full-size tiles have).
    "conv": ("test_cuda_sim.py", dict(NUMBACONV_CUDA_TILE="4,8,4", NUMBACONV_CUDA_THREADS="32",
                                      NUMBACONV_CUDA_GEMM_TILE="8,16,8,2,2")),
    # The recurrent ops on T=3, N=3, I=4, H=5 with small tiles and blocks, so that every GEMM
    # tile and element-wise block is partly filled.
    "rnn": ("test_cuda_rnn_sim.py", dict(NUMBACONV_CUDA_TILE="4,8,4",
                                         NUMBACONV_CUDA_THREADS="32")),
}

#: A hang guard, not a budget: more than twice what the longest of these runs (the compile
#: run) has taken beside the suite on the slowest CI machine seen (docs/cuda.md, "How it is
#: tested").
TIMEOUT_S = 2400
HAS_NUMBA_CUDA = importlib.util.find_spec("numba_cuda") is not None

#: The tests that compile for real GPUs: minutes of single-threaded NVVM and ptxas work that
#: the other core takes, one pytest run of both files in a subprocess beside the rest of the
#: suite, so that the kernels both files compile are lowered once (machine_code.ptx). Run on
#: their own (``pytest tests/test_cuda_compile.py``), the files run in the session as any
#: other. Declared first: the longest of these runs starts first.
COMPILE_FILES = ("test_cuda_compile.py", "test_cuda_machine_code.py")
_COMPILE_PATHS = tuple(os.path.join(HERE, name) for name in COMPILE_FILES)
COMPILER = background.Command(
    "the cuda compile and machine-code tests",
    ["-m", "pytest", "-q", "-rs", "-p", "no:cacheprovider", *_COMPILE_PATHS],
    first=True, timeout=TIMEOUT_S, enabled=HAS_NUMBA_CUDA, replaces=_COMPILE_PATHS)

SIMULATORS = {
    name: background.Command(
        f"the {name} kernels under the CUDA simulator",
        ["-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", os.path.join(HERE, test_file)],
        dict(NUMBA_ENABLE_CUDASIM="1", **settings), first=True, timeout=TIMEOUT_S,
        enabled=HAS_NUMBA_CUDA)
    for name, (test_file, settings) in SIMULATOR_RUNS.items()}


def _passed(command, test_file=None):
    """Assert that a pytest run in the background passed, with nothing skipped. A run of
    several files: ``test_file``'s part of it, which skips the waiting test where that file
    skipped (a tool missing; the run lists its skips, ``-rs``)."""
    done = command.result()
    assert done.returncode is not None, f"{command.name} took more than {done.timeout:.0f} s"
    assert done.returncode == 0, done.stdout[-6000:] + done.stderr[-3000:]
    lines = done.stdout.strip().splitlines()
    last = lines[-1] if lines else ""
    if test_file is not None:
        skips = [line for line in lines
                 if line.startswith("SKIPPED") and f"{test_file}:" in line]
        if skips:
            pytest.skip(f"{command.name}: " + "; ".join(skips))
    assert " passed" in last, done.stdout[-3000:]
    if test_file is None:
        assert "skipped" not in last, done.stdout[-3000:]


@needs_numba_cuda
@SIMULATORS["conv"].mark
def test_kernels_under_the_simulator():
    """Every convolution op and algorithm (tests/test_cuda_sim.py), see SIMULATOR_RUNS."""
    _passed(SIMULATORS["conv"])


@needs_numba_cuda
@SIMULATORS["rnn"].mark
def test_rnn_kernels_under_the_simulator():
    """The recurrent ops (tests/test_cuda_rnn_sim.py), see SIMULATOR_RUNS."""
    _passed(SIMULATORS["rnn"])


@needs_numba_cuda
@COMPILER.mark
def test_kernels_compile_for_real_gpus():
    """Every kernel compiles for sm_80 and sm_90 (tests/test_cuda_compile.py), see
    COMPILER."""
    _passed(COMPILER, COMPILE_FILES[0])


@needs_numba_cuda
@COMPILER.mark
def test_machine_code():
    """The GEMMs' and recurrent loops' sm_90 machine code (tests/test_cuda_machine_code.py),
    see COMPILER."""
    _passed(COMPILER, COMPILE_FILES[1])


def test_a_run_of_two_files_is_read_file_by_file():
    """_passed on a background pytest run: a file skipped as a whole (a tool missing) skips
    its own waiting test only; a failure fails both; a one-file run may skip nothing."""
    class Run:
        name = "the run"

        def __init__(self, stdout, returncode=0):
            self.done = background.Done(returncode, stdout, "", 10.0)

        def result(self):
            return self.done

    out = ("....s\n=== short test summary info ===\nSKIPPED [1] tests/test_cuda_machine_code.py"
           ":28: ptxas (numba-cuda[cu12]) or nvdisasm (nvidia-cuda-nvdisasm) is missing\n"
           "4 passed, 1 skipped in 3.00s\n")
    _passed(Run(out), COMPILE_FILES[0])
    with pytest.raises(pytest.skip.Exception, match="nvdisasm"):
        _passed(Run(out), COMPILE_FILES[1])
    for name in COMPILE_FILES:
        with pytest.raises(AssertionError):
            _passed(Run("..F\n1 failed, 2 passed in 1.00s\n", returncode=1), name)
    with pytest.raises(AssertionError):
        _passed(Run(out))


@needs_numba_cuda
def test_the_weight_gradient_split_avoids_a_last_wave_of_few_blocks():
    """The split of docs/cuda.md's model ("Weight gradient split-K") on the layers it was
    worked out for: a count of chunks whose blocks fill whole waves of 132 SMs."""
    from numbaconv.cuda._implicit_gemm import weight_chunks
    # 256c 14x14, N=32: 36 tiles of 128x128 (256 threads), 784 steps, 256 x 2304 partials.
    assert weight_chunks(36, 784, 256 * 2304, 256) == 7           # 252 blocks, one wave
    # 64c 56x56: 9 tiles of 64x64 (64 threads, eight blocks an SM), 12544 steps.
    assert weight_chunks(9, 12544, 64 * 576, 64) == 117           # 1053 of 1056 slots
    # 128c 56x56 stride 2: 9 tiles of 128x128, 3136 steps.
    assert weight_chunks(9, 3136, 128 * 1152, 256) == 29          # 261 of 264 slots
    # Partials are bounded, chunks never exceed the steps, and a tiny case is one step a chunk.
    assert weight_chunks(1, 10 ** 6, 1 << 24, 256) == 1
    assert weight_chunks(1, 3, 40, 32) == 3
    assert weight_chunks(2, 0, 40, 32) == 1
