"""Conformance testing for backends, and the case table shared by tests and benchmarks.

Third-party backend authors run::

    from numbaconv.testing import assert_backend_conforms
    assert_backend_conforms("mybackend")

which runs every op the backend supports on every case of :data:`CASES`, in both layouts and
both float dtypes, with and without ``out=``/``accumulate=True``, and compares each result with
the ``reference`` backend. Unsupported combinations are reported as skipped (with the
backend's reason), never as passed. :func:`check_rnn_backend` does the same for the recurrent
ops on :data:`RNN_CASES`. :func:`algorithm_forced` runs a backend's ops on one of its
algorithms whatever the dispatcher chose (for tests and for timing one against another).
"""

from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass, field

import numpy as np

from .conv import (conv, conv_backward_bias, conv_backward_data, conv_backward_weight,
                   conv_output_shape, conv_transpose)
from . import _operands
from ._operands import random_array
from .dispatch import NoBackendError, use_backend
from .problem import CONV_OPS, LAYOUTS, RNN_OPS, RNNConfig
from .rnn import rnn_backward_data, rnn_backward_weights, rnn_forward, rnn_init_params

#: Relative tolerance (max abs error / max abs reference value) per dtype.
TOLERANCE = {"float16": 2e-2, "float32": 2e-5, "float64": 1e-11}


@dataclass(frozen=True)
class ConvCase:
    """One convolution geometry, channels-first logical shapes.

    ``x_shape`` is ``(N, C, *S)``, ``w_shape`` ``(K, C // groups, *R)``; the transposed
    convolution of a case uses the same weight, takes an input of the forward output's shape
    and ``output_padding``.
    """

    name: str
    x_shape: tuple
    w_shape: tuple
    stride: object = 1
    padding: object = 0
    dilation: object = 1
    groups: int = 1
    output_padding: object = 0

    @property
    def kwargs(self) -> dict:
        return dict(stride=self.stride, padding=self.padding, dilation=self.dilation,
                    groups=self.groups)

    def physical_x_shape(self, layout: str) -> tuple:
        return _physical(self.x_shape, layout)

    def y_shape(self, layout: str) -> tuple:
        return conv_output_shape(self.physical_x_shape(layout), self.w_shape,
                                     layout=layout, **self.kwargs)


def _physical(shape, layout):
    shape = tuple(shape)
    return shape[:1] + shape[2:] + shape[1:2] if layout == "channels_last" else shape


#: Small problems covering every feature: 1D/2D/3D, each padding form, stride, dilation,
#: groups, depthwise (with a channel multiplier), 1x1 and whole-input kernels, strides larger
#: than the kernel, and transposed convolutions with output_padding >= stride.
CASES = (
    ConvCase("1d_basic", (2, 3, 11), (4, 3, 3)),
    ConvCase("1d_stride_dilation_groups", (2, 4, 17), (6, 2, 3), stride=2, padding=3,
             dilation=2, groups=2, output_padding=1),
    ConvCase("1d_asymmetric_stride3", (1, 3, 10), (2, 3, 4), stride=3, padding=((2, 1),),
             output_padding=2),
    ConvCase("2d_pad1", (2, 3, 7, 8), (4, 3, 3, 3), padding=1),
    ConvCase("2d_stride2", (2, 4, 9, 10), (6, 4, 3, 3), stride=2, padding=1,
             output_padding=1),
    ConvCase("2d_dilation", (1, 3, 10, 9), (2, 3, 3, 2), padding=(2, 1), dilation=(2, 3),
             output_padding=(1, 2)),
    ConvCase("2d_asymmetric", (2, 2, 8, 7), (3, 2, 3, 3), stride=(2, 1),
             padding=((0, 2), (1, 0))),
    ConvCase("2d_same_stride2", (2, 3, 9, 8), (4, 3, 3, 3), stride=2, padding="same"),
    ConvCase("2d_same_even_kernel", (1, 2, 7, 6), (3, 2, 4, 2), padding="SAME",
             dilation=(1, 2)),
    ConvCase("2d_valid", (2, 3, 8, 8), (5, 3, 5, 3), stride=(1, 2), padding="valid"),
    ConvCase("2d_groups", (2, 6, 7, 7), (9, 2, 3, 3), padding=1, groups=3),
    ConvCase("2d_depthwise", (2, 8, 9, 9), (8, 1, 3, 3), stride=2, padding=1, groups=8),
    ConvCase("2d_depthwise_multiplier", (1, 4, 6, 6), (8, 1, 3, 3), groups=4),
    ConvCase("2d_1x1", (2, 16, 5, 5), (8, 16, 1, 1)),
    ConvCase("2d_1x1_stride2", (2, 8, 6, 6), (4, 8, 1, 1), stride=2),
    ConvCase("2d_kernel_is_input", (2, 3, 5, 5), (4, 3, 5, 5)),
    ConvCase("2d_stride_over_kernel", (1, 2, 9, 10), (3, 2, 2, 2), stride=3),
    ConvCase("2d_stem7x7", (1, 3, 20, 20), (8, 3, 7, 7), stride=2, padding=3),
    ConvCase("3d_pad1", (1, 2, 5, 6, 4), (3, 2, 3, 3, 2), padding=1),
    ConvCase("3d_everything", (2, 4, 7, 6, 8), (4, 2, 2, 3, 3), stride=(2, 1, 2),
             padding=((1, 0), (2, 2), (0, 1)), dilation=(1, 2, 1), groups=2,
             output_padding=(1, 0, 0)),
)


def case(name: str) -> ConvCase:
    """The case of :data:`CASES` called ``name``."""
    for c in CASES:
        if c.name == name:
            return c
    raise KeyError(name)


def case_arrays(c: ConvCase, layout: str, dtype, seed: int = 0) -> dict:
    """Random x, w, bias, dy and the transposed conv's x (xt), dyt, bias_t for a case."""
    rng = np.random.default_rng(seed)
    xs = c.physical_x_shape(layout)
    ys = c.y_shape(layout)
    k = c.w_shape[0]
    cin = c.w_shape[1] * c.groups
    yt = conv_output_shape(ys, c.w_shape, layout=layout, transposed=True,
                               output_padding=c.output_padding, **c.kwargs)
    return dict(x=random_array(xs, dtype, rng), w=random_array(c.w_shape, dtype, rng),
                bias=random_array((k,), dtype, rng), dy=random_array(ys, dtype, rng),
                xt=random_array(ys, dtype, rng), dyt=random_array(yt, dtype, rng),
                bias_t=random_array((cin,), dtype, rng))


def run_op(op: str, c: ConvCase, layout: str, a: dict, **extra):
    """Call the public function for ``op`` on a case's arrays (``extra``: out, accumulate)."""
    kw = dict(c.kwargs, layout=layout, **extra)
    if op == "conv":
        return conv(a["x"], a["w"], a["bias"], **kw)
    if op == "conv_backward_data":
        return conv_backward_data(a["dy"], a["w"], a["x"].shape, **kw)
    if op == "conv_backward_weight":
        return conv_backward_weight(a["x"], a["dy"], a["w"].shape, **kw)
    if op == "conv_backward_bias":
        return conv_backward_bias(a["dy"], layout=layout, **extra)
    if op == "conv_transpose":
        return conv_transpose(a["xt"], a["w"], a["bias_t"],
                                  output_padding=c.output_padding, **kw)
    raise ValueError(f"op: expected one of {CONV_OPS}, got {op!r}")


def relative_error(actual, expected) -> float:
    actual = np.asarray(actual, dtype=np.float64)
    expected = np.asarray(expected, dtype=np.float64)
    if actual.shape != expected.shape:
        return math.inf
    scale = max(float(np.max(np.abs(expected), initial=0.0)), 1e-30)
    diff = np.abs(actual - expected)
    if np.isnan(diff).any():
        return math.inf
    return float(np.max(diff, initial=0.0)) / scale


@dataclass(frozen=True)
class CheckResult:
    """One (case, op, layout, dtype, mode) comparison with the reference."""

    backend: str
    case: str
    op: str
    layout: str
    dtype: str
    mode: str            # "plain", "out" or "accumulate"
    status: str          # "pass", "FAIL" or "skip"
    error: float = 0.0
    detail: str = field(default="", compare=False)


def check_backend(name: str, cases=CASES, ops=CONV_OPS, layouts=LAYOUTS,
                  dtypes=("float32", "float64"), modes=("plain", "out", "accumulate"),
                  tolerance=None) -> list:
    """Run backend ``name`` against the reference; one :class:`CheckResult` per comparison.

    Each comparison also fails when the result has the wrong dtype or shape, when a result
    returned without ``out`` is not C-contiguous, when ``out`` is not the returned array, or
    when an operand was modified (operands are handed over read-only). Only CPU (NumPy)
    backends can be checked this way.
    """
    tolerance = dict(TOLERANCE, **(tolerance or {}))
    results = []
    for c in cases:
        for layout in layouts:
            for dtype in dtypes:
                arrays = case_arrays(c, layout, dtype)
                for op in ops:
                    with use_backend("reference"):
                        expected = run_op(op, c, layout, arrays)
                    for mode in modes:
                        if mode == "accumulate" and op in ("conv", "conv_transpose"):
                            continue  # these ops take no accumulate argument
                        results.append(_check_one(name, c, op, layout, dtype, mode, arrays,
                                                  expected, tolerance[dtype]))
    return results


def _check_one(name, c, op, layout, dtype, mode, arrays, expected, tol) -> CheckResult:
    def result(status, error=0.0, detail=""):
        return CheckResult(name, c.name, op, layout, dtype, mode, status, error, detail)

    start = random_array(expected.shape, dtype, np.random.default_rng(1))
    extra = {}
    if mode != "plain":
        extra["out"] = start.copy()
    if mode == "accumulate":
        extra["accumulate"] = True
        expected = start + expected
    frozen = {}
    for key, value in arrays.items():
        frozen[key] = value.copy()
        frozen[key].flags.writeable = False
    try:
        with use_backend(name):
            got = run_op(op, c, layout, frozen, **extra)
    except NoBackendError as exc:
        return result("skip", detail=str(exc))
    except Exception as exc:
        return result("FAIL", math.inf, f"{type(exc).__name__}: {exc}")
    problems = []
    if mode != "plain" and got is not extra["out"]:
        problems.append("did not return out")
    if not isinstance(got, np.ndarray):
        return result("FAIL", math.inf, f"returned {type(got).__name__}, not an array")
    if got.dtype != np.dtype(dtype):
        problems.append(f"result dtype {got.dtype}, expected {dtype}")
    if mode == "plain" and not got.flags.c_contiguous:
        problems.append("result not C-contiguous")
    changed = [k for k in arrays if not np.array_equal(arrays[k], frozen[k])]
    if changed:
        problems.append(f"modified operands {changed}")
    err = relative_error(got, expected)
    if err > tol:
        problems.append(f"relative error {err:.3g} > {tol:g}")
    return result("FAIL" if problems else "pass", err, "; ".join(problems))


def assert_backend_conforms(name: str, *, allow_skips: bool = True, **kwargs) -> list:
    """:func:`check_backend`, raising AssertionError listing every failure.

    Also fails when nothing at all was compared (a backend that declines everything), and,
    with ``allow_skips=False``, when the backend declined any problem.
    """
    results = check_backend(name, **kwargs)
    failures = [r for r in results if r.status == "FAIL"]
    if not allow_skips:
        failures += [r for r in results if r.status == "skip"]
    if failures:
        lines = "\n".join(f"  {r.case} {r.op} {r.layout} {r.dtype} {r.mode}: {r.status} "
                          f"{r.detail}" for r in failures[:40])
        raise AssertionError(f"backend {name!r}: {len(failures)} of {len(results)} "
                             f"comparisons failed:\n{lines}")
    if not any(r.status == "pass" for r in results):
        raise AssertionError(f"backend {name!r} supported none of the {len(results)} "
                             f"problems checked")
    return results


# --- recurrent networks --------------------------------------------------------------------

@dataclass(frozen=True)
class RNNCase:
    """A small recurrent problem: a configuration, T, N and optional sequence lengths."""

    name: str
    config: RNNConfig
    seq_len: int
    batch: int
    seq_lengths: tuple = None
    dropout_seed: int = 3


#: Small RNN problems covering every mode and feature (checked by ``numbaconv check``).
RNN_CASES = (
    RNNCase("lstm_proj_bi_2l_dropout_lengths",
            RNNConfig("lstm", 3, 4, num_layers=2, bidirectional=True, proj_size=2,
                      dropout=0.3), 5, 3, (5, 2, 4)),
    RNNCase("lstm_batch_first", RNNConfig("lstm", 4, 6, batch_first=True), 7, 4),
    RNNCase("gru_bi_2l", RNNConfig("gru", 3, 4, num_layers=2, bidirectional=True), 5, 3),
    RNNCase("gru_lengths_nobias", RNNConfig("gru", 3, 5, bias=False), 6, 3, (1, 6, 3)),
    RNNCase("rnn_tanh_bi", RNNConfig("rnn_tanh", 3, 4, bidirectional=True), 4, 2),
    RNNCase("rnn_relu_2l_lengths", RNNConfig("rnn_relu", 3, 5, num_layers=2), 6, 3, (6, 1, 3)),
)


def _rnn_arrays(c: RNNCase, dtype, seed: int = 0) -> dict:
    cfg, rng = c.config, np.random.default_rng(seed)
    t, n = c.seq_len, c.batch
    states = cfg.num_layers * cfg.num_directions
    x_shape = (n, t, cfg.input_size) if cfg.batch_first else (t, n, cfg.input_size)
    y_last = cfg.num_directions * cfg.out_size
    a = dict(x=random_array(x_shape, dtype, rng),
             params=rnn_init_params(cfg, seed=seed, dtype=dtype),
             hx=random_array((states, n, cfg.out_size), dtype, rng),
             dy=random_array(x_shape[:2] + (y_last,), dtype, rng),
             dhy=random_array((states, n, cfg.out_size), dtype, rng))
    if cfg.mode == "lstm":
        a["cx"] = random_array((states, n, cfg.hidden_size), dtype, rng)
        a["dcy"] = random_array((states, n, cfg.hidden_size), dtype, rng)
    return a


def _rnn_step(c: RNNCase, a: dict, **weights_extra) -> dict:
    """Training forward, backward data and backward weights of one case (current backend)."""
    cfg, cx, dcy = c.config, a.get("cx"), a.get("dcy")
    y, hy, cy, reserve = rnn_forward(cfg, a["x"], a["params"], a["hx"], cx,
                                     seq_lengths=c.seq_lengths, training=True,
                                     dropout_seed=c.dropout_seed)
    dx, dhx, dcx = rnn_backward_data(cfg, y, a["dy"], a["params"], reserve, hx=a["hx"],
                                     cx=cx, dhy=a["dhy"], dcy=dcy,
                                     seq_lengths=c.seq_lengths)
    dparams = rnn_backward_weights(cfg, a["x"], a["params"], reserve, hx=a["hx"],
                                   seq_lengths=c.seq_lengths, **weights_extra)
    return dict(rnn_forward=(y, hy, cy), rnn_backward_data=(dx, dhx, dcx),
                rnn_backward_weights=(dparams,))


def check_rnn_backend(name: str, cases=RNN_CASES, dtypes=("float32", "float64"),
                      modes=("plain", "out", "accumulate"), tolerance=None) -> list:
    """Run backend ``name``'s recurrent ops against the reference: per case and dtype, a
    training step (forward with dropout and lengths where the case has them, backward data,
    backward weights with each of ``modes``); one :class:`CheckResult` per op and mode
    (``layout`` is ``"-"``). Operands are handed over read-only."""
    tolerance = dict(TOLERANCE, **(tolerance or {}))
    results = []
    for c in cases:
        for dtype in dtypes:
            arrays = _rnn_arrays(c, dtype)
            with use_backend("reference"):
                expected = _rnn_step(c, arrays)
            frozen = {}
            for key, value in arrays.items():
                frozen[key] = value.copy()
                frozen[key].flags.writeable = False
            for mode in modes:
                extra = {}
                start = random_array(arrays["params"].shape, dtype, np.random.default_rng(1))
                if mode != "plain":
                    extra["out"] = start.copy()
                if mode == "accumulate":
                    extra["accumulate"] = True
                ops = RNN_OPS if mode == "plain" else ("rnn_backward_weights",)

                def result(op, status, error=0.0, detail=""):
                    return CheckResult(name, c.name, op, "-", dtype, mode, status, error,
                                       detail)
                try:
                    with use_backend(name):
                        got = _rnn_step(c, frozen, **extra)
                except NoBackendError as exc:
                    results += [result(op, "skip", detail=str(exc)) for op in ops]
                    continue
                except Exception as exc:
                    results += [result(op, "FAIL", math.inf, f"{type(exc).__name__}: {exc}")
                                for op in ops]
                    continue
                changed = [k for k in arrays if not np.array_equal(arrays[k], frozen[k])]
                for op in ops:
                    want = expected[op]
                    if op == "rnn_backward_weights" and mode == "accumulate":
                        want = (start + want[0],)
                    problems = [f"modified operands {changed}"] if changed else []
                    if mode != "plain" and got[op][0] is not extra["out"]:
                        problems.append("did not return out")
                    err = 0.0
                    for g, w in zip(got[op], want):
                        if (g is None) != (w is None):
                            problems.append("None where the reference has an array, or "
                                            "the reverse")
                        elif g is not None:
                            if g.dtype != np.dtype(dtype):
                                problems.append(f"result dtype {g.dtype}, expected {dtype}")
                            err = max(err, relative_error(g, w))
                    if err > tolerance[dtype]:
                        problems.append(f"relative error {err:.3g} > {tolerance[dtype]:g}")
                    results.append(result(op, "FAIL" if problems else "pass", err,
                                          "; ".join(problems)))
    return results


#: Random operands for an op on a problem (what the autotuner times), re-exported.
random_operands = _operands.random_operands


@contextlib.contextmanager
def algorithm_forced(backend, ops, algorithm, *, strict: bool = False):
    """Inside, the backend class ``backend`` runs ``ops`` (a sequence of op names: a
    ValueError otherwise) on ``algorithm`` whatever the dispatcher chose, where it offers
    that algorithm for the problem (with ``strict``, a ValueError where it does not). The
    dispatcher caches its choice per problem, so the backend's ``run`` is what is switched
    (for every instance of the class).

    Yields a dict: ``"runs"`` counts the forced runs; set ``"algorithm"`` to another one,
    or to None to force nothing, inside the block.

    Examples
    --------
    >>> from numbaconv.cpu import CpuBackend
    >>> with algorithm_forced(CpuBackend, ("conv",), "im2col") as forced:
    ...     y = conv(np.ones((1, 2, 4, 4)), np.ones((3, 2, 3, 3)))
    >>> forced["runs"]
    1
    """
    if isinstance(ops, str) or not all(op in CONV_OPS + RNN_OPS for op in ops):
        raise ValueError(f"ops: expected a sequence of op names from {CONV_OPS + RNN_OPS}, "
                         f"got {ops!r}")
    state = {"algorithm": algorithm, "runs": 0}
    own = "run" in vars(backend)
    run = backend.run

    def forced(self, op, problem, operands, out, chosen):
        wanted = state["algorithm"]
        if wanted is not None and op in ops:
            if wanted in self.algorithms(op, problem):
                state["runs"] += 1
                chosen = wanted
            elif strict:
                raise ValueError(f"algorithm: {type(self).__name__} does not offer "
                                 f"{wanted!r} for {op} on this problem")
        return run(self, op, problem, operands, out, chosen)

    backend.run = forced
    try:
        yield state
    finally:
        if own:
            backend.run = run
        else:
            del backend.run
