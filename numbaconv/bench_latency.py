"""What a call costs besides its arithmetic: the dispatcher's overhead per call on a tiny
problem, and the first call of each op (JIT compilation, or loading from Numba's on-disk
cache), timed in fresh processes."""

from __future__ import annotations

import dataclasses
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Callable, Optional, Sequence

from . import dispatch
from .bench_cases import TINY, BenchCase, make_call
from .bench_timing import _autonumber, collector_off, per_call
from .problem import CONV_OPS
from .testing import ConvCase


# --- dispatch overhead -------------------------------------------------------------------

def dispatch_callables(op: str, *, case: ConvCase = TINY, layout: str = "channels_first",
                       dtype: str = "float32"):
    """The public call of ``op`` on a tiny problem and the selected backend's direct ``run``.

    The direct call gets exactly what the dispatcher would hand the backend (the validated
    problem, C-contiguous operands, the chosen algorithm), so the difference between the
    two is validation, normalisation and selection alone.

    Returns
    -------
    public : Call
        Calling it makes the public call.
    direct : callable
        Calls the backend's ``run`` without validation or dispatch.
    choice : Choice
        The dispatcher's choice for this problem (honours ``use_backend`` and
        ``NUMBACONV_BACKEND``).
    """
    call = make_call(op, case, layout, dtype)
    choice = dispatch.select(op, call.problem)
    backend = dispatch.get_backend(choice.backend)
    run, problem, operands, algorithm = backend.run, call.problem, call.operands, \
        choice.algorithm

    def direct():
        return run(op, problem, operands, None, algorithm)

    return call, direct, choice


def dispatch_overhead(ops: Sequence[str] = CONV_OPS, *, repeat: int = 31,
                      min_sample: float = 2e-3, layout: str = "channels_first",
                      dtype: str = "float32", settle: float = 0.0) -> list:
    """What validation and dispatch add to a call, in microseconds, per op.

    For the :data:`TINY` problem, the median time of the public function minus the median
    time of the selected backend's ``run`` with pre-validated operands. Samples of the two
    alternate so that frequency scaling and noisy neighbours hit both alike.

    Parameters
    ----------
    ops : sequence of str
    repeat : int
        Samples of each (the medians are taken over them).
    min_sample : float
        Seconds one sample lasts at least (many calls per sample).
    layout, dtype : str
    settle : float
        Seconds to wait first, for thread pools of earlier work to go idle (see
        :data:`DEFAULT_SETTLE`).

    Returns
    -------
    list of dict
        Per op: ``op``, ``backend``, ``algorithm``, ``public_us``, ``direct_us``,
        ``overhead_us``, ``number`` (calls per sample) and ``repeat``.
    """
    if settle > 0:
        time.sleep(settle)
    results = []
    for op in ops:
        public, direct, choice = dispatch_callables(op, layout=layout, dtype=dtype)
        public()
        direct()  # warm both: compilation, caches, the dispatcher's choice
        number = max(_autonumber(public, min_sample), _autonumber(direct, min_sample))
        t_public, t_direct = [], []
        with collector_off():
            for _ in range(repeat):
                t_public.append(per_call(public, number))
                t_direct.append(per_call(direct, number))
        public_us = statistics.median(t_public) * 1e6
        direct_us = statistics.median(t_direct) * 1e6
        results.append(dict(op=op, backend=choice.backend, algorithm=choice.algorithm,
                            public_us=public_us, direct_us=direct_us,
                            overhead_us=public_us - direct_us, number=number,
                            repeat=repeat))
    return results


# --- first-call latency ------------------------------------------------------------------

#: The problem of :func:`first_call_latency`: small, so that its first call measures
#: compilation (or loading from Numba's cache), not arithmetic, and shaped like a ResNet
#: layer, so that the cpu backend picks the algorithms it picks there (``winograd`` for the
#: forward and the data gradient: 64 channels, 128 tiles; ``implicit`` for the weight
#: gradient: rows of 16 pixels).
FIRST_CALL_CASE = BenchCase("first_call_3x3_64c_16", (2, 64, 16, 16), (64, 64, 3, 3),
                            padding=1, group="resnet3x3")

#: Run by each fresh interpreter of :func:`first_call_latency`; argv[1] is a JSON spec. It
#: prints one JSON line. Kernels and Numba's cache hits are counted by
#: :func:`numbaconv._warmup.compiled_kernels`, as warm-up counts them.
_FIRST_CALL_SCRIPT = r"""
import json, sys, time
start = time.perf_counter()
import numbaconv
import_s = time.perf_counter() - start
numba_at_import = "numba" in sys.modules
spec = json.loads(sys.argv[1])
from numbaconv import bench, dispatch
def as_tuple(value):  # JSON made the case's tuples lists
    return tuple(map(as_tuple, value)) if isinstance(value, list) else value
case = bench.BenchCase(**{k: as_tuple(v) for k, v in spec["case"].items()})
ops = spec["op"].split("+")  # "conv+conv_backward_data+...": a training step's ops
calls = [bench.make_call(op, case, spec["layout"], spec["dtype"]) for op in ops]
def call():
    for c in calls:
        c()
# The first call would import Numba itself (the kernel modules do); importing it just
# before costs the same and tells that fixed part apart from compiling or loading kernels.
start = time.perf_counter()
try:
    import numba
except ImportError:  # a backend without Numba
    pass
numba_import_s = time.perf_counter() - start
with numbaconv.use_backend(spec["backend"]):
    start = time.perf_counter()
    call()
    call_s = time.perf_counter() - start
    start = time.perf_counter()
    call()
    second_s = time.perf_counter() - start
    choices = [dispatch.select(op, c.problem) for op, c in zip(ops, calls)]
from numbaconv._warmup import compiled_kernels
counted = compiled_kernels("numbaconv")
kernels, hits, misses = counted["signatures"], counted["hits"], counted["misses"]
print(json.dumps(dict(import_s=import_s, numba_at_import=numba_at_import,
                      numba_import_s=numba_import_s, call_s=call_s,
                      first_s=numba_import_s + call_s, second_s=second_s,
                      backend="+".join(dict.fromkeys(c.backend for c in choices)),
                      algorithm="+".join(c.algorithm for c in choices),
                      kernels=kernels, cache_hits=hits, cache_misses=misses)))
"""


#: The ops of a training step with biases, run one after another by
#: ``first_call_latency([TRAINING_STEP])`` in one interpreter.
TRAINING_STEP = "+".join(CONV_OPS)


def first_call_latency(ops: Sequence[str] = CONV_OPS, backend: str = "cpu", *,
                       case: ConvCase = FIRST_CALL_CASE, layout: str = "channels_first",
                       dtype: str = "float32", threads: Optional[int] = None,
                       timeout: float = 600.0,
                       progress: Optional[Callable[[str], None]] = None) -> list:
    """Time of each op's first call in a fresh process, cold and from Numba's disk cache.

    For each op, a new temporary directory becomes ``NUMBA_CACHE_DIR`` of two fresh
    interpreters (``sys.executable``), run one after the other. Each imports numbaconv and
    times the op's first call on ``case`` inside ``use_backend(backend)``, then a second
    call. Numba is imported just before the first call and timed apart: the call would
    otherwise import it, and that part costs the same cold or cached. The first interpreter
    finds the cache empty: its first call compiles (and writes the cache). The second finds
    the first one's kernels on disk: its first call loads them.

    ``NUMBACONV_JIT_CACHE=1`` is set in both interpreters' environment, whatever this
    process has: with it off the kernels would never reach the disk and the "cached" call
    would compile again. ``NUMBACONV_AUTOTUNE=0`` keeps the first call to the one algorithm
    the dispatcher picks, and ``NUMBACONV_CACHE_DIR`` points into the temporary directory
    too, so that nothing is read from or written to the user's caches.

    Parameters
    ----------
    ops : sequence of str
        Op names; an entry may join several with ``+`` (:data:`TRAINING_STEP`): those ops
        run one after another in the same interpreters, and the times are their sums.
    backend : str
        A numbaconv backend name.
    case : ConvCase
        The problem (channels-first logical shapes).
    layout, dtype : str
    threads : int, optional
        ``NUMBA_NUM_THREADS`` of the interpreters (inherited when omitted).
    timeout : float
        Seconds each interpreter may take.
    progress : callable, optional
        Called with a line of text as each interpreter starts.

    Returns
    -------
    list of dict
        One per op: ``op``, ``backend``, ``layout``, ``dtype``, ``case`` (its name),
        ``cold`` and ``cached``. Each of the last two is the interpreter's report:
        ``import_s`` (``import numbaconv``), ``numba_at_import`` (whether that import
        loaded Numba), ``numba_import_s``, ``call_s`` (the first call without importing
        Numba), ``first_s`` (the two together: the first call as a user sees it),
        ``second_s``, the ``backend`` and ``algorithm`` that ran,
        ``kernels`` (compiled signatures of numbaconv's Numba kernels after the calls),
        ``cache_hits`` and ``cache_misses`` (Numba's statistics); or ``{"error": text}``.
    """
    import numbaconv
    case_spec = {f.name: getattr(case, f.name) for f in dataclasses.fields(BenchCase)
                 if hasattr(case, f.name)}
    # The interpreters must import this very numbaconv, installed or not.
    package_root = os.path.dirname(os.path.dirname(os.path.abspath(numbaconv.__file__)))
    results = []
    for op in ops:
        spec = json.dumps(dict(op=op, backend=backend, layout=layout, dtype=dtype,
                               case=case_spec))
        with tempfile.TemporaryDirectory(prefix="numbaconv-first-call-") as cache_dir:
            env = dict(os.environ, NUMBA_CACHE_DIR=cache_dir, NUMBACONV_JIT_CACHE="1",
                       NUMBACONV_AUTOTUNE="0",
                       NUMBACONV_CACHE_DIR=os.path.join(cache_dir, "numbaconv"))
            env["PYTHONPATH"] = os.pathsep.join(
                [package_root] + [p for p in [os.environ.get("PYTHONPATH")] if p])
            if threads is not None:
                env["NUMBA_NUM_THREADS"] = str(threads)
            if progress is not None:
                progress(f"{op}: cold (compiling)")
            cold = _first_call_process(spec, env, timeout)
            if progress is not None:
                progress(f"{op}: cached (loading)")
            cached = _first_call_process(spec, env, timeout)
        results.append(dict(op=op, backend=backend, layout=layout, dtype=dtype,
                            case=case.name, cold=cold, cached=cached))
    return results


def _first_call_process(spec: str, env: dict, timeout: float) -> dict:
    try:
        proc = subprocess.run([sys.executable, "-c", _FIRST_CALL_SCRIPT, spec], env=env,
                              capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return dict(error=f"no answer within {timeout:g} s")
    lines = proc.stdout.strip().splitlines()
    if proc.returncode != 0 or not lines:
        tail = (proc.stderr.strip().splitlines() or [f"exit status {proc.returncode}"])[-1]
        return dict(error=tail)
    try:
        return json.loads(lines[-1])
    except ValueError:
        return dict(error=f"unreadable report: {lines[-1][:200]}")
