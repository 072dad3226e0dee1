"""Normalised, hashable problem descriptions: the contract between numbaconv and its backends.

Every public function validates its arguments exactly once, through the builders in this
module, and hands the resulting problem to the dispatcher and then to one backend. A backend
never sees raw user arguments: padding is always one ``(before, after)`` pair per spatial
dimension, shapes are always given channels-first, dtypes are names.

The convolution convention (see :mod:`numbaconv._geometry`)::

    y[n, k, p] = sum over c in k's group, r in the kernel of
                 w[k, c, r] * x[n, group(k) * C/groups + c, p * stride - before + r * dilation]

with zeros read outside the input. ``output_size`` is authoritative: for ordinary
convolutions it equals the usual formula; for a transposed convolution whose
``output_padding`` is at least the stride it may be shorter than the formula gives, and
positions past it simply do not exist.

Problems are frozen dataclasses: hashable, comparable, printable, and stable across releases
(new fields are only ever added with defaults). Plugin authors may rely on every field and
property documented here.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from dataclasses import dataclass

import numpy as np

from . import _geometry as geo
from ._checks import ArrayInfo, check_operands, check_out, inspect_array
from .rnn_problem import (RESERVE_BACKWARD_DATA, RESERVE_FORWARD, RESERVE_HEADER,
                          RESERVE_MAGIC, RNN_MODES, RNNConfig, RNNProblem, RNNReserveLayout,
                          check_config, check_reserve, check_seq_lengths, layer_params,
                          lengths_tag, record_header, reserve_header,
                          rnn_backward_data_problem,
                          rnn_backward_weights_problem, rnn_forward_problem, rnn_param_views,
                          rnn_reserve_layout, shifted_in_time)

# The recurrent problems (numbaconv.rnn_problem) and the shared checks (numbaconv._checks)
# are re-exported: backends and plugins import them from here.
__all__ = ["CONV_OPS", "RNN_OPS", "OPS", "LAYOUTS", "DEVICES", "ConvProblem", "BiasProblem",
           "check_layout", "check_ndim", "logical", "check_weight", "check_shape_arg",
           "check_groups_value", "check_groups", "layout_hint", "check_output_size",
           "conv_geometry", "conv_problem", "conv_backward_data_problem",
           "conv_backward_weight_problem", "conv_backward_bias_problem",
           "conv_transpose_problem", "check_needs", "check_gradient", "PROBLEM_BUILDERS",
           "ArrayInfo", "check_operands", "check_out", "inspect_array", "RNN_MODES",
           "RNNConfig", "rnn_param_views", "layer_params", "RESERVE_MAGIC", "RESERVE_HEADER",
           "RESERVE_FORWARD", "RESERVE_BACKWARD_DATA",
           "RNNReserveLayout", "shifted_in_time", "rnn_reserve_layout", "RNNProblem",
           "check_config", "check_seq_lengths", "lengths_tag", "reserve_header", "record_header",
           "check_reserve", "rnn_forward_problem", "rnn_backward_data_problem",
           "rnn_backward_weights_problem"]

#: Names of the operations the dispatcher knows.
CONV_OPS = ("conv", "conv_backward_data", "conv_backward_weight", "conv_backward_bias",
            "conv_transpose")
RNN_OPS = ("rnn_forward", "rnn_backward_data", "rnn_backward_weights")
OPS = CONV_OPS + RNN_OPS

LAYOUTS = ("channels_first", "channels_last")
DEVICES = ("cpu", "cuda")


@dataclass(frozen=True)
class ConvProblem:
    """One convolution operation, fully normalised.

    The geometry is always that of the *forward* convolution ``x (N, C, *S) * w (K, C/groups,
    *R) -> y (N, K, *P)``, whatever the op: ``conv_backward_data`` produces dx of x's shape,
    ``conv_backward_weight`` produces dw of w's shape, and ``conv_transpose`` maps a tensor of
    y's shape to one of x's shape (it *is* the data gradient, plus an optional bias over C).

    Attributes
    ----------
    op : str
        One of ``"conv"``, ``"conv_backward_data"``, ``"conv_backward_weight"``,
        ``"conv_transpose"``.
    batch : int
        N.
    in_channels, out_channels : int
        C and K of the forward convolution (for ``conv_transpose`` the transposed output has C
        channels, its input K).
    groups : int
        Divides C and K; ``groups == in_channels`` is depthwise.
    input_size, kernel_size, output_size : tuple of int
        S, R and P, one entry per spatial dimension.
    stride, dilation : tuple of int
        One entry (>= 1) per spatial dimension.
    padding : tuple of (int, int)
        ``(before, after)`` zero padding per spatial dimension, as resolved from the user's
        form (``"same"`` included). ``after`` only matters through ``output_size``.
    output_padding : tuple of int
        Zeros except for ``conv_transpose`` (kept for information; ``input_size`` includes it).
    layout : str
        ``"channels_first"`` or ``"channels_last"``: the memory order of x, y, dx and dy.
        Weights are always ``(K, C/groups, *R)``.
    dtype : str
        ``"float16"``, ``"float32"`` or ``"float64"``, shared by every operand.
    device : str
        ``"cpu"`` (NumPy arrays) or ``"cuda"`` (``__cuda_array_interface__``).
    has_bias : bool
        Whether a bias operand is present (``conv`` and ``conv_transpose``).
    accumulate : bool
        Add into ``out`` instead of overwriting it (cuDNN beta = 1).
    """

    op: str
    batch: int
    in_channels: int
    out_channels: int
    groups: int
    input_size: tuple
    kernel_size: tuple
    output_size: tuple
    stride: tuple
    dilation: tuple
    padding: tuple
    output_padding: tuple
    layout: str = "channels_first"
    dtype: str = "float32"
    device: str = "cpu"
    has_bias: bool = False
    accumulate: bool = False

    # -- derived quantities -------------------------------------------------------------
    @property
    def ndim(self) -> int:
        """Number of spatial dimensions (1, 2 or 3)."""
        return len(self.input_size)

    @property
    def numpy_dtype(self) -> np.dtype:
        return np.dtype(self.dtype)

    @property
    def channels_last(self) -> bool:
        return self.layout == "channels_last"

    @property
    def depthwise(self) -> bool:
        """One input channel per group (``groups == C``), any channel multiplier."""
        return self.groups == self.in_channels and self.groups > 1

    @property
    def padding_before(self) -> tuple:
        return tuple(b for b, _ in self.padding)

    @property
    def trailing_padding(self) -> tuple:
        """Trailing zeros the last window reads per dim (negative: input tail never read)."""
        return tuple(geo.trailing_padding(self.input_size[i], self.output_size[i],
                                          self.kernel_size[i], self.stride[i],
                                          self.dilation[i], self.padding[i][0])
                     for i in range(self.ndim))

    @property
    def frame_padding(self) -> tuple:
        """``(before, trailing_padding)`` per dim: the zero frame around x that the windows
        read. Pad (or, where negative, crop) x by these and a padding-free convolution gives
        exactly ``output_size``; prefer this to ``padding`` in kernels."""
        return tuple(zip(self.padding_before, self.trailing_padding))

    @property
    def x_shape(self) -> tuple:
        """Physical shape of x and dx in ``layout``."""
        return _physical(self.batch, self.in_channels, self.input_size, self.layout)

    @property
    def y_shape(self) -> tuple:
        """Physical shape of y and dy in ``layout``."""
        return _physical(self.batch, self.out_channels, self.output_size, self.layout)

    @property
    def w_shape(self) -> tuple:
        """Shape of w and dw: ``(K, C // groups, *R)``."""
        return (self.out_channels, self.in_channels // self.groups) + self.kernel_size

    @property
    def result_shape(self) -> tuple:
        """Shape of what ``op`` returns."""
        return {"conv": self.y_shape, "conv_backward_data": self.x_shape,
                "conv_backward_weight": self.w_shape, "conv_transpose": self.x_shape}[self.op]

    @property
    def flops(self) -> int:
        """Floating-point operations (2 per multiply-add) of the op's main contraction."""
        return geo.flops(self.batch, self.in_channels, self.out_channels, self.groups,
                         self.output_size, self.kernel_size)

    def key(self) -> str:
        """A stable, human-readable string identifying the problem (autotune cache key)."""
        return (f"{self.op}:N{self.batch}:C{self.in_channels}:K{self.out_channels}"
                f":g{self.groups}:S{_dims(self.input_size)}:R{_dims(self.kernel_size)}"
                f":P{_dims(self.output_size)}:s{_dims(self.stride)}:d{_dims(self.dilation)}"
                f":p{'x'.join(f'{b}-{a}' for b, a in self.padding)}"
                f":{self.layout}:{self.dtype}:{self.device}"
                f":bias{int(self.has_bias)}:acc{int(self.accumulate)}")

    def with_op(self, op: str, *, has_bias: bool = False, accumulate: bool = False):
        """The same geometry for another op (used to split composite calls)."""
        return dataclasses.replace(self, op=op, has_bias=has_bias, accumulate=accumulate)


@dataclass(frozen=True)
class BiasProblem:
    """``conv_backward_bias``: db[k] = sum of dy[n, k, *p] over batch and space.

    Attributes
    ----------
    op : str
        Always ``"conv_backward_bias"``.
    batch, channels : int
        N and K of dy.
    output_size : tuple of int
        Spatial shape P of dy.
    layout, dtype, device, accumulate
        As in :class:`ConvProblem`.
    """

    op: str
    batch: int
    channels: int
    output_size: tuple
    layout: str = "channels_first"
    dtype: str = "float32"
    device: str = "cpu"
    accumulate: bool = False

    @property
    def ndim(self) -> int:
        return len(self.output_size)

    @property
    def numpy_dtype(self) -> np.dtype:
        return np.dtype(self.dtype)

    @property
    def channels_last(self) -> bool:
        return self.layout == "channels_last"

    @property
    def y_shape(self) -> tuple:
        return _physical(self.batch, self.channels, self.output_size, self.layout)

    @property
    def result_shape(self) -> tuple:
        return (self.channels,)

    @property
    def flops(self) -> int:
        return self.batch * self.channels * math.prod(self.output_size)

    def key(self) -> str:
        return (f"{self.op}:N{self.batch}:K{self.channels}:P{_dims(self.output_size)}"
                f":{self.layout}:{self.dtype}:{self.device}:acc{int(self.accumulate)}")


# --- validation: the one path every public function takes -------------------------------

def check_layout(layout) -> str:
    if not isinstance(layout, str) or layout not in LAYOUTS:
        raise ValueError(f"layout: expected 'channels_first' or 'channels_last', "
                         f"got {layout!r}")
    return layout


def check_ndim(info: ArrayInfo, ndim: int, what: str) -> None:
    if len(info.shape) != ndim:
        raise ValueError(f"{info.name}: expected {ndim} dimensions ({what}), got shape "
                         f"{info.shape}")


def logical(shape: tuple, layout: str) -> tuple:
    """(N, C, spatial) of a physical activation shape."""
    if layout == "channels_last":
        return shape[0], shape[-1], tuple(shape[1:-1])
    return shape[0], shape[1], tuple(shape[2:])


def check_weight(info_or_shape, name: str, spatial_ndim: int | None = None) -> tuple:
    """A weight shape ``(K, C/groups, *R)`` with 1 to 3 spatial dims, all sizes >= 1."""
    shape = tuple(info_or_shape.shape if isinstance(info_or_shape, ArrayInfo)
                  else info_or_shape)
    if not 3 <= len(shape) <= 5:
        raise ValueError(f"{name}: expected 3 to 5 dimensions (out_channels, "
                         f"in_channels/groups, 1 to 3 kernel sizes), got shape {shape}")
    if spatial_ndim is not None and len(shape) != spatial_ndim + 2:
        raise ValueError(f"{name}: expected {spatial_ndim + 2} dimensions to match the "
                         f"data's {spatial_ndim} spatial dims, got shape {shape}")
    if any(s < 1 for s in shape):
        raise ValueError(f"{name}: expected every size >= 1, got shape {shape}")
    return shape


def check_shape_arg(value, name: str, ndim: int) -> tuple:
    """A user-given shape (input_shape, weight_shape): a tuple of ndim positive ints."""
    if not isinstance(value, (tuple, list)) or not all(geo._is_int(v) for v in value):
        raise TypeError(f"{name}: expected a tuple of {ndim} ints, got {value!r}")
    shape = tuple(int(v) for v in value)
    if len(shape) != ndim:
        raise ValueError(f"{name}: expected {ndim} dimensions, got {shape}")
    if any(s < 1 for s in shape):
        raise ValueError(f"{name}: expected every size >= 1, got {shape}")
    return shape


def check_groups_value(groups) -> int:
    if not geo._is_int(groups):
        raise TypeError(f"groups: expected an int, got {groups!r}")
    if groups < 1:
        raise ValueError(f"groups: expected an int >= 1, got {groups}")
    return int(groups)


def check_groups(groups, in_channels: int, out_channels: int, per_group: int,
                 weight_name: str, data_name: str) -> int:
    """groups divides C and K, and the weight's second dim is C / groups."""
    groups = check_groups_value(groups)
    if out_channels % groups:
        raise ValueError(f"groups: expected a divisor of out_channels ({out_channels} from "
                         f"{weight_name}), got {groups}")
    if in_channels % groups:
        raise ValueError(f"groups: expected a divisor of in_channels ({in_channels} from "
                         f"{data_name}), got {groups}")
    if per_group * groups != in_channels:
        raise ValueError(f"{weight_name}: expected dim 1 = in_channels / groups = "
                         f"{in_channels} / {groups} = {in_channels // groups} (channels of "
                         f"{data_name}), got {per_group}")
    return groups


_OTHER_LAYOUT = {"channels_first": "channels_last", "channels_last": "channels_first"}
_CHANNEL_AXIS = {"channels_first": "axis 1", "channels_last": "the last axis"}


def layout_hint(layout: str, groups, out_channels: int, operands) -> str | None:
    """The error for channel counts that match only under the other layout, or None.

    ``operands`` holds ``(name, shape, expected channels, where that comes from)`` for each
    activation (or activation shape) whose channels a channel check compares. The hint is
    given when some of them mismatch under ``layout`` and every one matches under the other
    layout (with ``groups`` dividing ``out_channels``, which no layout changes), so that
    passing the other layout is the whole fix.
    """
    other = _OTHER_LAYOUT.get(layout)
    if other is None or not geo._is_int(groups) or groups < 1 or out_channels % groups:
        return None
    now = [logical(tuple(shape), layout)[1] for _, shape, _, _ in operands]
    then = [logical(tuple(shape), other)[1] for _, shape, _, _ in operands]
    expected = [e for _, _, e, _ in operands]
    if now == expected or then != expected:
        return None
    names = " and ".join(f"{name} {tuple(shape)}" for name, shape, _, _ in operands)
    their = "its" if len(operands) == 1 else "their"

    def values(vals):
        return " and ".join(str(v) for v in vals)

    wanted = " and ".join(f"{e} ({why})" for _, _, e, why in operands)
    shape = "(N, *S, C)" if other == "channels_last" else "(N, C, *S)"
    return (f"{names}: with layout={layout!r} {their} channels are {_CHANNEL_AXIS[layout]} "
            f"({values(now)}), expected {wanted}; {_CHANNEL_AXIS[other]} ({values(then)}) "
            f"{'matches' if len(operands) == 1 else 'match'}: pass layout={other!r} if the data is {other.replace('_', '-')} "
            f"{shape}")


def _hinting(layout, groups, out_channels, operands, check):
    """Run ``check`` (the channel checks); a ValueError it raises becomes the layout hint
    where :func:`layout_hint` gives one."""
    try:
        return check()
    except ValueError as exc:
        hint = layout_hint(layout, groups, out_channels, operands)
        if hint is None:
            raise
        raise ValueError(f"{hint}. (Under layout={layout!r}: {exc})") from None


def check_output_size(out_size: tuple, name: str, what: str) -> None:
    if any(p < 1 for p in out_size):
        raise ValueError(f"{name}: the convolution output would be empty ({what} gives "
                         f"spatial size {out_size}); expected every size >= 1")


def conv_geometry(stride, padding, dilation, input_size, kernel_size):
    """Normalised stride, dilation and padding pairs for a forward geometry."""
    ndim = len(kernel_size)
    stride = geo.normalize_int_tuple(stride, ndim, "stride", 1)
    dilation = geo.normalize_int_tuple(dilation, ndim, "dilation", 1)
    pads = geo.normalize_padding(padding, ndim, input_size, kernel_size, stride, dilation)
    return stride, dilation, pads


def _physical(batch, channels, spatial, layout):
    if layout == "channels_last":
        return (batch,) + tuple(spatial) + (channels,)
    return (batch, channels) + tuple(spatial)


def _dims(t):
    return "x".join(str(v) for v in t)


# --- builders: one per public entry point, all sharing the checks above -----------------

class _Uncacheable(Exception):
    pass


def _metadata(value):
    """What validation reads of one positional argument, as a hashable key part."""
    if value is None:
        return None
    if isinstance(value, np.ndarray):
        return type(value), value.shape, value.dtype
    if isinstance(value, (tuple, list)):
        return repr(value)  # input_shape / weight_shape; repr tells 1 from True
    cai = getattr(value, "__cuda_array_interface__", None)
    if cai is not None:     # what inspect_array reads of a CUDA array
        return type(value), tuple(cai["shape"]), cai["typestr"]
    raise _Uncacheable  # e.g. the simulator's arrays: validate every time


def _remembered(result_shape):
    """Cache a builder's problem by what validation reads, so repeated calls on the same
    shapes skip it (about 10 of the 15 microseconds a small call spends outside the kernel).

    The key holds the arrays' types, shapes and dtypes, and the ``repr`` of every keyword
    (so ``True`` never stands in for ``1``); only successful validations are remembered, and
    ``out`` and ``accumulate`` are checked on every call.
    """
    def decorate(builder):
        cache: dict = {}

        @functools.wraps(builder)
        def validated(*args, out=None, accumulate=False, **kwargs):
            try:
                key = (tuple(map(_metadata, args)), type(accumulate), accumulate,
                       repr(kwargs))
                problem = cache.get(key)
            except (_Uncacheable, TypeError):
                return builder(*args, out=out, accumulate=accumulate, **kwargs)
            if problem is None:
                problem = builder(*args, out=out, accumulate=accumulate, **kwargs)
                if len(cache) >= 1024:
                    cache.clear()
                cache[key] = problem
                return problem
            if out is not None or accumulate is not False:
                check_out(out, result_shape(problem), problem.device, problem.dtype,
                          accumulate, args)
            return problem

        validated.cache = cache
        return validated
    return decorate


def _activation(name, value, layout, ndim=None):
    info = inspect_array(name, value)
    if ndim is not None:
        check_ndim(info, ndim + 2, "batch, channels and the weight's spatial dims")
    elif not 3 <= len(info.shape) <= 5:
        raise ValueError(f"{name}: expected 3 to 5 dimensions, got shape {info.shape}")
    batch, channels, spatial = logical(info.shape, layout)
    if batch < 1 or channels < 1 or any(s < 1 for s in spatial):
        raise ValueError(f"{name}: expected every size >= 1 (empty arrays are not "
                         f"supported), got shape {info.shape}")
    return info, batch, channels, spatial


def _check_bias(bias, channels, what):
    if bias is None:
        return None
    info = inspect_array("bias", bias)
    if info.shape != (channels,):
        raise ValueError(f"bias: expected shape ({channels},) ({what}), got {info.shape}")
    return info


@_remembered(lambda p: p.y_shape)
def conv_problem(x, w, bias=None, *, stride=1, padding=0, dilation=1, groups=1,
                 layout="channels_first", out=None, accumulate=False) -> ConvProblem:
    """Validate the arguments of :func:`numbaconv.conv`."""
    layout = check_layout(layout)
    winfo = inspect_array("w", w)
    wshape = check_weight(winfo, "w")
    nd = len(wshape) - 2
    xinfo, n, c, s = _activation("x", x, layout, nd)
    binfo = _check_bias(bias, wshape[0], "out_channels of w")
    device, dtype = check_operands(*(i for i in (xinfo, winfo, binfo) if i is not None))
    groups = _hinting(layout, groups, wshape[0], [
        ("x", xinfo.shape, wshape[1] * groups if geo._is_int(groups) else None,
         "w's dim 1 * groups")],
        lambda: check_groups(groups, c, wshape[0], wshape[1], "w", "x"))
    r = wshape[2:]
    stride, dilation, pads = conv_geometry(stride, padding, dilation, s, r)
    p = geo.output_shape(s, r, stride, dilation, pads)
    check_output_size(p, "x", f"input {s}, kernel {r}, stride {stride}, dilation "
                      f"{dilation}, padding {pads}")
    problem = ConvProblem("conv", n, c, wshape[0], groups, s, r, p, stride, dilation, pads,
                          (0,) * nd, layout, dtype, device, bias is not None, bool(accumulate))
    check_out(out, problem.y_shape, device, dtype, accumulate, (x, w, bias))
    return problem


@_remembered(lambda p: p.x_shape)
def conv_backward_data_problem(dy, w, input_shape, *, stride=1, padding=0, dilation=1,
                               groups=1, layout="channels_first", out=None,
                               accumulate=False) -> ConvProblem:
    """Validate the arguments of :func:`numbaconv.conv_backward_data`."""
    layout = check_layout(layout)
    winfo = inspect_array("w", w)
    wshape = check_weight(winfo, "w")
    nd = len(wshape) - 2
    dyinfo, n, k, p = _activation("dy", dy, layout, nd)
    device, dtype = check_operands(dyinfo, winfo)
    xshape = check_shape_arg(input_shape, "input_shape", nd + 2)
    xn, c, s = logical(xshape, layout)
    if xn != n:
        raise ValueError(f"input_shape: expected batch size {n} (from dy), got {xn} in "
                         f"{xshape}")

    def channels():
        if k != wshape[0]:
            raise ValueError(f"dy: expected {wshape[0]} channels (out_channels of w), got "
                             f"{k} in shape {dyinfo.shape}")
        return check_groups(groups, c, wshape[0], wshape[1], "w", "input_shape")

    groups = _hinting(layout, groups, wshape[0], [
        ("dy", dyinfo.shape, wshape[0], "w's dim 0"),
        ("input_shape", xshape, wshape[1] * groups if geo._is_int(groups) else None,
         "w's dim 1 * groups")], channels)
    r = wshape[2:]
    stride, dilation, pads = conv_geometry(stride, padding, dilation, s, r)
    expected = geo.output_shape(s, r, stride, dilation, pads)
    check_output_size(expected, "input_shape", f"input {s}, kernel {r}")
    if expected != p:
        raise ValueError(f"dy: expected spatial size {expected} (the convolution output of "
                         f"input_shape {xshape}), got {p} in shape {dyinfo.shape}")
    problem = ConvProblem("conv_backward_data", n, c, k, groups, s, r, p, stride, dilation,
                          pads, (0,) * nd, layout, dtype, device, False, bool(accumulate))
    check_out(out, problem.x_shape, device, dtype, accumulate, (dy, w))
    return problem


@_remembered(lambda p: p.w_shape)
def conv_backward_weight_problem(x, dy, weight_shape, *, stride=1, padding=0, dilation=1,
                                 groups=1, layout="channels_first", out=None,
                                 accumulate=False) -> ConvProblem:
    """Validate the arguments of :func:`numbaconv.conv_backward_weight`."""
    layout = check_layout(layout)
    xinfo = inspect_array("x", x)
    if not 3 <= len(xinfo.shape) <= 5:
        raise ValueError(f"x: expected 3 to 5 dimensions, got shape {xinfo.shape}")
    nd = len(xinfo.shape) - 2
    wshape = check_weight(check_shape_arg(weight_shape, "weight_shape", nd + 2),
                          "weight_shape", nd)
    xinfo, n, c, s = _activation("x", x, layout, nd)
    dyinfo, dn, k, p = _activation("dy", dy, layout, nd)
    device, dtype = check_operands(xinfo, dyinfo)
    if dn != n:
        raise ValueError(f"dy: expected batch size {n} (from x), got {dn} in shape "
                         f"{dyinfo.shape}")

    def channels():
        if k != wshape[0]:
            raise ValueError(f"dy: expected {wshape[0]} channels (out_channels of "
                             f"weight_shape), got {k} in shape {dyinfo.shape}")
        return check_groups(groups, c, wshape[0], wshape[1], "weight_shape", "x")

    groups = _hinting(layout, groups, wshape[0], [
        ("x", xinfo.shape, wshape[1] * groups if geo._is_int(groups) else None,
         "weight_shape[1] * groups"),
        ("dy", dyinfo.shape, wshape[0], "weight_shape[0]")], channels)
    r = wshape[2:]
    stride, dilation, pads = conv_geometry(stride, padding, dilation, s, r)
    expected = geo.output_shape(s, r, stride, dilation, pads)
    check_output_size(expected, "x", f"input {s}, kernel {r}")
    if expected != p:
        raise ValueError(f"dy: expected spatial size {expected} (the convolution output of "
                         f"x), got {p} in shape {dyinfo.shape}")
    problem = ConvProblem("conv_backward_weight", n, c, k, groups, s, r, p, stride, dilation,
                          pads, (0,) * nd, layout, dtype, device, False, bool(accumulate))
    check_out(out, problem.w_shape, device, dtype, accumulate, (x, dy))
    return problem


@_remembered(lambda p: (p.channels,))
def conv_backward_bias_problem(dy, *, layout="channels_first", out=None,
                               accumulate=False) -> BiasProblem:
    """Validate the arguments of :func:`numbaconv.conv_backward_bias`."""
    layout = check_layout(layout)
    dyinfo, n, k, p = _activation("dy", dy, layout)
    device, dtype = check_operands(dyinfo)
    problem = BiasProblem("conv_backward_bias", n, k, p, layout, dtype, device,
                          bool(accumulate))
    check_out(out, (k,), device, dtype, accumulate, (dy,))
    return problem


@_remembered(lambda p: p.x_shape)
def conv_transpose_problem(x, w, bias=None, *, stride=1, padding=0, output_padding=0,
                           dilation=1, groups=1, layout="channels_first", out=None,
                           accumulate=False) -> ConvProblem:
    """Validate the arguments of :func:`numbaconv.conv_transpose`.

    The problem describes the forward convolution whose data gradient this is: the
    transposed input x has the forward output's shape ``(N, K, *P)`` and the result the
    forward input's ``(N, C, *S)``, with ``w`` of shape ``(K, C/groups, *R)``.
    """
    layout = check_layout(layout)
    winfo = inspect_array("w", w)
    wshape = check_weight(winfo, "w")
    nd = len(wshape) - 2
    xinfo, n, k, p = _activation("x", x, layout, nd)

    def channels():
        if k != wshape[0]:
            raise ValueError(f"x: expected {wshape[0]} channels (dim 0 of the transposed "
                             f"weight w), got {k} in shape {xinfo.shape}")

    _hinting(layout, groups, wshape[0], [("x", xinfo.shape, wshape[0], "w's dim 0")],
             channels)
    c = wshape[1] * check_groups_value(groups)
    binfo = _check_bias(bias, c, "groups * dim 1 of w")
    device, dtype = check_operands(*(i for i in (xinfo, winfo, binfo) if i is not None))
    groups = check_groups(groups, c, k, wshape[1], "w", "the result")
    r = wshape[2:]
    stride = geo.normalize_int_tuple(stride, nd, "stride", 1)
    dilation = geo.normalize_int_tuple(dilation, nd, "dilation", 1)
    opad = geo.normalize_int_tuple(output_padding, nd, "output_padding", 0)
    for i in range(nd):
        if opad[i] >= max(stride[i], dilation[i]):
            raise ValueError(f"output_padding: expected each value < max(stride, dilation) "
                             f"= {tuple(max(a, b) for a, b in zip(stride, dilation))}, "
                             f"got {opad}")
    if isinstance(padding, str):
        mode = padding.lower()
        if mode == "same":
            if any(opad):
                raise ValueError(f"output_padding: expected 0 with padding='same' (the "
                                 f"output is input * stride), got {opad}")
            s = tuple(p[i] * stride[i] for i in range(nd))
        elif mode == "valid":
            s = tuple(geo.transposed_output_size(p[i], r[i], stride[i], dilation[i], 0, 0,
                                                 opad[i]) for i in range(nd))
        else:
            s = None  # normalize_padding below raises the error
        pads = geo.normalize_padding(padding, nd, s, r, stride, dilation)
    else:
        pads = geo.normalize_padding(padding, nd, None, r, stride, dilation)
        s = tuple(geo.transposed_output_size(p[i], r[i], stride[i], dilation[i],
                                             pads[i][0], pads[i][1], opad[i])
                  for i in range(nd))
    check_output_size(s, "x", f"transposed input {p}, kernel {r}, stride {stride}, "
                      f"dilation {dilation}, padding {pads}, output_padding {opad}")
    problem = ConvProblem("conv_transpose", n, c, k, groups, s, r, p, stride, dilation, pads,
                          opad, layout, dtype, device, bias is not None, bool(accumulate))
    check_out(out, problem.x_shape, device, dtype, accumulate, (x, w, bias))
    return problem


def check_needs(needs) -> tuple:
    if (not isinstance(needs, (tuple, list)) or len(needs) != 3
            or not all(isinstance(v, (bool, np.bool_)) for v in needs)):
        raise TypeError(f"needs: expected a tuple of 3 bools (dx, dw, db), got {needs!r}")
    return tuple(bool(v) for v in needs)


def check_gradient(dy, expected_shape: tuple, device: str, dtype: str, what: str) -> None:
    info = inspect_array("dy", dy)
    check_operands(ArrayInfo("x", device, dtype, (), None), info)
    if info.shape != tuple(expected_shape):
        raise ValueError(f"dy: expected shape {tuple(expected_shape)} ({what}), got "
                         f"{info.shape}")


# --- one builder per op --------------------------------------------------------------------

def _problem_only(builder):
    """``builder`` returning only the problem of its ``(problem, lengths)``."""
    @functools.wraps(builder)
    def build(*args, **kwargs):
        return builder(*args, **kwargs)[0]
    return build


#: The validating builder of each op in :data:`OPS`: called with exactly the arguments of the
#: op's public function, it returns the op's problem description (``explain`` and ``warmup``
#: build problems through it; the recurrent builders' sequence lengths are dropped).
PROBLEM_BUILDERS = {
    "conv": conv_problem,
    "conv_backward_data": conv_backward_data_problem,
    "conv_backward_weight": conv_backward_weight_problem,
    "conv_backward_bias": conv_backward_bias_problem,
    "conv_transpose": conv_transpose_problem,
    "rnn_forward": _problem_only(rnn_forward_problem),
    "rnn_backward_data": _problem_only(rnn_backward_data_problem),
    "rnn_backward_weights": _problem_only(rnn_backward_weights_problem),
}
