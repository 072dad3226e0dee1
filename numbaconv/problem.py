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
import zlib
from dataclasses import dataclass, field

import numpy as np

from . import _geometry as geo

#: Names of the operations the dispatcher knows.
CONV_OPS = ("conv", "conv_backward_data", "conv_backward_weight", "conv_backward_bias",
            "conv_transpose")
RNN_OPS = ("rnn_forward", "rnn_backward_data", "rnn_backward_weights")
OPS = CONV_OPS + RNN_OPS

LAYOUTS = ("channels_first", "channels_last")
DEVICES = ("cpu", "cuda")
_CPU_DTYPES = ("float32", "float64")
_CUDA_DTYPES = ("float16", "float32", "float64")


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

@dataclass(frozen=True)
class ArrayInfo:
    """What validation learned about one operand: its device, dtype and shape."""

    name: str
    device: str
    dtype: str
    shape: tuple
    array: object = field(repr=False, compare=False)


_DTYPE_NAMES: dict = {}


def _dtype_name(dtype) -> str:
    # np.dtype.name is computed in Python on every access; this runs on every call.
    try:
        return _DTYPE_NAMES[dtype]
    except KeyError:
        name = _DTYPE_NAMES[dtype] = np.dtype(dtype).name
        return name


def inspect_array(name: str, value) -> ArrayInfo:
    """Device, dtype and shape of a NumPy array or a ``__cuda_array_interface__`` object."""
    if isinstance(value, np.ndarray):
        return ArrayInfo(name, "cpu", _dtype_name(value.dtype), value.shape, value)
    cai = getattr(value, "__cuda_array_interface__", None)
    if cai is not None:
        return ArrayInfo(name, "cuda", _dtype_name(cai["typestr"]), tuple(cai["shape"]),
                         value)
    if getattr(value, "__cuda_ndarray__", False):
        # Numba's device arrays under its simulator (NUMBA_ENABLE_CUDASIM=1) carry this
        # marker but no __cuda_array_interface__; the CUDA tests run on them.
        return ArrayInfo(name, "cuda", _dtype_name(value.dtype), tuple(value.shape), value)
    raise TypeError(f"{name}: expected a NumPy array or a CUDA array "
                    f"(__cuda_array_interface__), got {type(value).__name__}")


def check_operands(*infos: ArrayInfo) -> tuple[str, str]:
    """One device and one float dtype shared by every operand; returns (device, dtype)."""
    first = infos[0]
    for info in infos:
        if info.device != first.device:
            raise ValueError(f"{info.name}: expected an array on the same device as "
                             f"{first.name} ({first.device}), got one on {info.device}")
    allowed = _CPU_DTYPES if first.device == "cpu" else _CUDA_DTYPES
    for info in infos:
        if info.dtype not in allowed:
            raise TypeError(f"{info.name}: expected dtype {' or '.join(allowed)} on "
                            f"{info.device}, got {info.dtype}")
        if info.dtype != first.dtype:
            raise TypeError(f"{info.name}: expected dtype {first.dtype} like {first.name} "
                            f"(mixed dtypes are not cast), got {info.dtype}")
    return first.device, first.dtype


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


def check_out(out, expected_shape: tuple, device: str, dtype: str, accumulate,
              inputs: tuple) -> None:
    """``out`` has the exact shape, dtype and device, is writable and overlaps no input."""
    if not isinstance(accumulate, (bool, np.bool_)):
        raise TypeError(f"accumulate: expected True or False, got {accumulate!r}")
    if out is None:
        if accumulate:
            raise ValueError("accumulate: expected out= to accumulate into, got out=None")
        return
    info = inspect_array("out", out)
    if info.device != device:
        raise ValueError(f"out: expected an array on {device}, got one on {info.device}")
    if info.dtype != dtype:
        raise TypeError(f"out: expected dtype {dtype}, got {info.dtype}")
    if info.shape != tuple(expected_shape):
        raise ValueError(f"out: expected shape {tuple(expected_shape)}, got {info.shape}")
    if device == "cpu":
        if not out.flags.writeable:
            raise ValueError("out: expected a writable array, got a read-only one")
        for arr in inputs:
            if arr is not None and isinstance(arr, np.ndarray) and \
                    np.may_share_memory(out, arr):
                raise ValueError("out: expected memory separate from the inputs, got an "
                                 "array that overlaps one of them")


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


# --- recurrent networks ------------------------------------------------------------------

#: RNN modes and the number of gate blocks each computes per step.
RNN_MODES = {"rnn_tanh": 1, "rnn_relu": 1, "lstm": 4, "gru": 3}


def _positive_int(value, name: str, minimum: int = 1) -> int:
    if not isinstance(value, (int, np.integer)) or isinstance(value, (bool, np.bool_)):
        raise TypeError(f"{name}: expected an int, got {value!r}")
    if value < minimum:
        raise ValueError(f"{name}: expected an int >= {minimum}, got {value}")
    return int(value)


def _flag_value(value, name: str) -> bool:
    if not isinstance(value, (bool, np.bool_)):
        raise TypeError(f"{name}: expected True or False, got {value!r}")
    return bool(value)


@dataclass(frozen=True)
class RNNConfig:
    """A recurrent network's architecture, as PyTorch's ``nn.RNN``/``nn.LSTM``/``nn.GRU``.

    Parameters
    ----------
    mode : str
        ``"rnn_tanh"``, ``"rnn_relu"``, ``"lstm"`` or ``"gru"``.
    input_size, hidden_size : int
        Features of x and of the hidden state (the cell state, for an LSTM).
    num_layers : int
        Stacked layers; layer l > 0 reads layer l - 1's output.
    bidirectional : bool
        A second direction per layer reading the sequence backwards; outputs are
        concatenated along the feature axis (forward first).
    bias : bool
        Whether each layer has ``bias_ih`` and ``bias_hh``.
    dropout : float
        In [0, 1): inverted dropout on the inputs of layers 1 .. num_layers - 1, in training
        only.
    proj_size : int
        LSTM only: 0, or the size (< hidden_size) of the projected hidden state
        ``h = weight_hr @ (o * tanh(c))``.
    batch_first : bool
        x, y, dy and dx are ``(N, T, features)`` instead of ``(T, N, features)``; states are
        always ``(num_layers * num_directions, N, size)``.

    Equations, gate order and parameter shapes are PyTorch's (GRU applies the reset gate
    after the hidden product, so its ``n`` slices of ``bias_ih`` and ``bias_hh`` differ).
    """

    mode: str
    input_size: int
    hidden_size: int
    num_layers: int = 1
    bidirectional: bool = False
    bias: bool = True
    dropout: float = 0.0
    proj_size: int = 0
    batch_first: bool = False

    def __post_init__(self):
        if not isinstance(self.mode, str) or self.mode not in RNN_MODES:
            raise ValueError(f"mode: expected one of {sorted(RNN_MODES)}, got {self.mode!r}")
        set_ = functools.partial(object.__setattr__, self)
        set_("input_size", _positive_int(self.input_size, "input_size"))
        set_("hidden_size", _positive_int(self.hidden_size, "hidden_size"))
        set_("num_layers", _positive_int(self.num_layers, "num_layers"))
        set_("bidirectional", _flag_value(self.bidirectional, "bidirectional"))
        set_("bias", _flag_value(self.bias, "bias"))
        set_("batch_first", _flag_value(self.batch_first, "batch_first"))
        set_("proj_size", _positive_int(self.proj_size, "proj_size", 0))
        if isinstance(self.dropout, (bool, np.bool_)) or \
                not isinstance(self.dropout, (int, float, np.integer, np.floating)):
            raise TypeError(f"dropout: expected a float in [0, 1), got {self.dropout!r}")
        if not 0.0 <= float(self.dropout) < 1.0:
            raise ValueError(f"dropout: expected a float in [0, 1), got {self.dropout!r}")
        set_("dropout", float(self.dropout))
        if self.proj_size:
            if self.mode != "lstm":
                raise ValueError(f"proj_size: expected 0 for mode {self.mode!r} (projections "
                                 f"are LSTM only), got {self.proj_size}")
            if self.proj_size >= self.hidden_size:
                raise ValueError(f"proj_size: expected a value < hidden_size "
                                 f"({self.hidden_size}), got {self.proj_size}")

    @property
    def num_directions(self) -> int:
        """2 if bidirectional, else 1."""
        return 2 if self.bidirectional else 1

    @property
    def out_size(self) -> int:
        """Features of each direction's output and hidden state: proj_size or hidden_size."""
        return self.proj_size or self.hidden_size

    @property
    def gates(self) -> int:
        """Gate blocks per step: 1 (RNN), 4 (LSTM: i, f, g, o) or 3 (GRU: r, z, n)."""
        return RNN_MODES[self.mode]

    def layer_input_size(self, layer: int) -> int:
        """Features read by ``layer``: input_size for layer 0, else D * out_size."""
        return self.input_size if layer == 0 else self.num_directions * self.out_size

    @functools.cached_property
    def param_layout(self) -> tuple:
        """``(name, offset, shape)`` of every parameter in the flat vector, in order.

        The order is PyTorch's ``_flat_weights_names``: for each layer, for each direction,
        ``weight_ih``, ``weight_hh``, ``bias_ih`` and ``bias_hh`` (with bias), ``weight_hr``
        (with proj_size); names carry ``_l{layer}`` and ``_reverse`` for direction 1.
        """
        entries, offset = [], 0
        gh = self.gates * self.hidden_size
        for layer in range(self.num_layers):
            for direction in range(self.num_directions):
                suffix = f"_l{layer}" + ("_reverse" if direction else "")
                shapes = [("weight_ih", (gh, self.layer_input_size(layer))),
                          ("weight_hh", (gh, self.out_size))]
                if self.bias:
                    shapes += [("bias_ih", (gh,)), ("bias_hh", (gh,))]
                if self.proj_size:
                    shapes.append(("weight_hr", (self.proj_size, self.hidden_size)))
                for name, shape in shapes:
                    entries.append((name + suffix, offset, shape))
                    offset += math.prod(shape)
        return tuple(entries)

    @property
    def num_params(self) -> int:
        """Length of the flat parameter vector."""
        _, offset, shape = self.param_layout[-1]
        return offset + math.prod(shape)

    def key(self) -> str:
        return (f"{self.mode}:I{self.input_size}:H{self.hidden_size}:L{self.num_layers}"
                f":D{self.num_directions}:bias{int(self.bias)}:p{self.dropout:g}"
                f":proj{self.proj_size}")


def rnn_param_views(config: RNNConfig, flat) -> dict:
    """PyTorch-named views into the flat parameter vector (writing a view writes ``flat``).

    Parameters
    ----------
    config : RNNConfig
    flat : 1-D array of ``config.num_params`` elements (NumPy or CUDA)

    Returns
    -------
    dict
        ``{"weight_ih_l0": (G*H, input_size) view, "weight_hh_l0": (G*H, out_size), "bias_ih_l0":
        (G*H,), "bias_hh_l0": (G*H,), "weight_hr_l0": (proj_size, H), ...}`` in the flat
        order, ``_reverse`` names for the second direction.
    """
    if not isinstance(config, RNNConfig):
        raise TypeError(f"config: expected an RNNConfig, got {type(config).__name__}")
    info = inspect_array("flat", flat)
    if len(info.shape) != 1 or info.shape[0] != config.num_params:
        raise ValueError(f"flat: expected a 1-D array of {config.num_params} elements "
                         f"(config.num_params), got shape {info.shape}")
    return {name: flat[offset:offset + math.prod(shape)].reshape(shape)
            for name, offset, shape in config.param_layout}


def layer_params(config: RNNConfig, flat, layer: int, direction: int) -> tuple:
    """``(weight_ih, weight_hh, bias_ih or None, bias_hh or None, weight_hr or None)`` views of
    one layer and direction, for backends."""
    per = 2 + 2 * config.bias + (1 if config.proj_size else 0)
    entries = config.param_layout[(layer * config.num_directions + direction) * per:][:per]
    views = [flat[o:o + math.prod(s)].reshape(s) for _, o, s in entries]
    w_ih, w_hh = views[0], views[1]
    b_ih, b_hh = (views[2], views[3]) if config.bias else (None, None)
    w_hr = views[-1] if config.proj_size else None
    return w_ih, w_hh, b_ih, b_hh, w_hr


#: Marks a reserve written by a training forward (header slot 0); below 2048, so that
#: float16 holds it exactly, like every header value.
RESERVE_MAGIC = 1737.0
#: Reserve states (header slot 1): after the training forward, after rnn_backward_data.
RESERVE_FORWARD, RESERVE_BACKWARD_DATA = 1.0, 2.0
RESERVE_HEADER = 16
_ALIGN = 16  # elements: 64 bytes in float32, so every region starts on a cache line


def _aligned(n: int) -> int:
    return -(-n // _ALIGN) * _ALIGN


@dataclass(frozen=True)
class RNNReserveLayout:
    """Where everything lives in a training forward's reserve (a 1-D array of the dtype).

    With T steps, N sequences, D directions, H = hidden_size, P = out_size, G = gates and
    Gw = G * H (``4H`` for the GRU, which also keeps its hidden-path ``n`` product), the
    regions, in order, each starting at a multiple of 16 elements:

    ============  =============================  ===========================================
    region        shape, per layer (x direction)  contents
    ============  =============================  ===========================================
    header        16                              magic, state, then T, N, a config tag and
                                                  a lengths tag as base-1024 digits, three
                                                  each (exact in float16 too)
    gates[l, d]   (T, N, Gw)                      forward: activations (RNN: h; LSTM: i, f,
                                                  g, o; GRU: r, z, n, W_hn h + b_hn); after
                                                  rnn_backward_data: the gradients of the
                                                  pre-activations (GRU: dr, dz, then r * dn
                                                  for the hidden path, dn for the input path)
    cells[l, d]   (T, N, H), LSTM only            forward: cell state after each step; after
                                                  rnn_backward_data with projection:
                                                  o * tanh(c), the projection's input
    dproj[l, d]   (T, N, P), LSTM with proj only  after rnn_backward_data: gradient of h
    outputs[l]    (T, N, D * P)                   the layer's output (the last layer's is y)
    masks[l]      (T, N, D * P), l >= 1, only     dropout scale (0 or 1 / (1 - p)) applied to
                  with dropout > 0                layer l's input
    ============  =============================  ===========================================

    Past a sequence's end, gates and dproj hold zeros and cells the carried state. Size:
    ``16 + sum of the aligned region sizes`` elements (:func:`numbaconv.rnn_reserve_size`).
    """

    config: RNNConfig
    seq_len: int
    batch: int

    @functools.cached_property
    def _regions(self) -> dict:
        cfg, t, n = self.config, self.seq_len, self.batch
        d, h, p = cfg.num_directions, cfg.hidden_size, cfg.out_size
        gw = (4 if cfg.mode == "gru" else cfg.gates) * h
        regions, offset = {}, RESERVE_HEADER

        def add(key, shape):
            nonlocal offset
            regions[key] = (offset, shape)
            offset += _aligned(math.prod(shape))

        for layer in range(cfg.num_layers):
            for direction in range(d):
                add(("gates", layer, direction), (t, n, gw))
                if cfg.mode == "lstm":
                    add(("cells", layer, direction), (t, n, h))
                if cfg.proj_size:
                    add(("dproj", layer, direction), (t, n, p))
            add(("outputs", layer), (t, n, d * p))
            if layer > 0 and cfg.dropout > 0:
                add(("masks", layer), (t, n, d * p))
        regions["size"] = offset
        return regions

    @property
    def size(self) -> int:
        """Elements the reserve must have."""
        return self._regions["size"]

    def _view(self, reserve, key):
        offset, shape = self._regions[key]
        return reserve[offset:offset + math.prod(shape)].reshape(shape)

    def gates(self, reserve, layer: int, direction: int):
        return self._view(reserve, ("gates", layer, direction))

    def cells(self, reserve, layer: int, direction: int):
        return self._view(reserve, ("cells", layer, direction))

    def dproj(self, reserve, layer: int, direction: int):
        return self._view(reserve, ("dproj", layer, direction))

    def outputs(self, reserve, layer: int):
        return self._view(reserve, ("outputs", layer))

    def masks(self, reserve, layer: int):
        """Layer ``layer``'s input dropout scales, or None without dropout."""
        key = ("masks", layer)
        return self._view(reserve, key) if key in self._regions else None

    def header(self, reserve):
        return reserve[:RESERVE_HEADER]

    def layer_input(self, reserve, layer: int, x):
        """What ``layer`` read in the training forward: x for layer 0, else the previous
        layer's outputs times this layer's dropout masks (a new array when masked)."""
        if layer == 0:
            return x
        inp = self.outputs(reserve, layer - 1)
        masks = self.masks(reserve, layer)
        return inp if masks is None else inp * masks

    def previous_states(self, reserve, layer: int, direction: int, h0, lengths):
        """The hidden state each step of (layer, direction) read, as a new (T, N, P) array:
        the previous step's output in processing order, or ``h0`` at a sequence's first
        step (t = 0 forwards; t = T - 1, or length - 1, backwards). CPU arrays only."""
        p = self.config.out_size
        outputs = self.outputs(reserve, layer)[:, :, direction * p:(direction + 1) * p]
        prev = shifted_in_time(outputs, h0, direction)
        if direction == 1 and lengths is not None:
            prev[lengths - 1, np.arange(len(lengths))] = h0
        return prev


def shifted_in_time(values, first, direction: int):
    """A new (T, ...) array holding, at each step, ``values`` at the step processed just
    before it (t - 1 forwards, t + 1 backwards), and ``first`` at the first step processed."""
    prev = np.empty(values.shape, values.dtype)
    if direction == 0:
        prev[0] = first
        prev[1:] = values[:-1]
    else:
        prev[-1] = first
        prev[:-1] = values[1:]
    return prev


@functools.lru_cache(maxsize=64)
def rnn_reserve_layout(config: RNNConfig, seq_len: int, batch: int) -> RNNReserveLayout:
    """The (cached) :class:`RNNReserveLayout` of a configuration and sequence shape."""
    return RNNReserveLayout(config, seq_len, batch)


@dataclass(frozen=True)
class RNNProblem:
    """One recurrent op, normalised: what the dispatcher and backends see.

    Backends always get time-major arrays (batch_first is undone by the public functions),
    C-contiguous and of ``dtype``; missing initial states and state gradients arrive as
    zeros. Operands of :meth:`Backend.run`, by op:

    ``rnn_forward``
        ``(x (T, N, I), params, hx, cx or None, lengths or None, reserve or None)`` ->
        ``(y, hy, cy or None)``; with ``training`` the reserve (laid out as
        :class:`RNNReserveLayout`, dropout masks already filled in) must be written.
    ``rnn_backward_data``
        ``(y, dy, params, reserve, hx, cx or None, dhy, dcy or None, lengths or None)`` ->
        ``(dx, dhx, dcx or None)``; overwrites the reserve's gates with their gradients.
    ``rnn_backward_weights``
        ``(x, params, reserve, hx, lengths or None)`` -> dparams (flat; honour ``out`` and
        ``accumulate``).

    ``lengths`` is an int64 array of N values in 1..T, or None when every sequence is T long.

    Attributes
    ----------
    op : str
    config : RNNConfig
    seq_len, batch : int
        T and N.
    dtype, device : str
    training : bool
        ``rnn_forward`` only: fill the reserve.
    variable_lengths : bool
        Whether ``lengths`` is given (some sequence is shorter than T).
    accumulate : bool
        ``rnn_backward_weights`` only: add into ``out``.
    """

    op: str
    config: RNNConfig
    seq_len: int
    batch: int
    dtype: str = "float32"
    device: str = "cpu"
    training: bool = False
    variable_lengths: bool = False
    accumulate: bool = False

    @property
    def numpy_dtype(self) -> np.dtype:
        return np.dtype(self.dtype)

    @property
    def reserve_layout(self) -> RNNReserveLayout:
        return rnn_reserve_layout(self.config, self.seq_len, self.batch)

    @property
    def flops(self) -> int:
        """Floating-point operations of the op's matrix products (2 per multiply-add)."""
        cfg = self.config
        gh, p = cfg.gates * cfg.hidden_size, cfg.out_size
        per_step = 0
        for layer in range(cfg.num_layers):
            per_step += cfg.num_directions * gh * (cfg.layer_input_size(layer) + p)
            if cfg.proj_size:
                per_step += cfg.num_directions * p * cfg.hidden_size
        return 2 * self.seq_len * self.batch * per_step

    def key(self) -> str:
        return (f"{self.op}:{self.config.key()}:T{self.seq_len}:N{self.batch}:{self.dtype}"
                f":{self.device}:train{int(self.training)}:var{int(self.variable_lengths)}"
                f":acc{int(self.accumulate)}")


# --- recurrent validation ------------------------------------------------------------------

def check_config(config) -> RNNConfig:
    if not isinstance(config, RNNConfig):
        raise TypeError(f"config: expected an RNNConfig, got {type(config).__name__}")
    return config


def _sequence(name: str, value, config: RNNConfig, features: int):
    """(info, T, N) of a (T, N, features) array, or (N, T, features) with batch_first."""
    info = inspect_array(name, value)
    order = "(N, T, features)" if config.batch_first else "(T, N, features)"
    if len(info.shape) != 3:
        raise ValueError(f"{name}: expected 3 dimensions {order}, got shape {info.shape}")
    t, n = info.shape[:2][::-1] if config.batch_first else info.shape[:2]
    if t < 1 or n < 1:
        raise ValueError(f"{name}: expected a non-empty sequence {order}, got shape "
                         f"{info.shape}")
    if info.shape[2] != features:
        raise ValueError(f"{name}: expected {features} features in the last dimension, got "
                         f"shape {info.shape}")
    return info, t, n


def _state(name: str, value, shape: tuple, infos: list, allowed: bool = True,
           why: str = ""):
    if value is None:
        return
    if not allowed:
        raise ValueError(f"{name}: expected None {why}, got an array")
    info = inspect_array(name, value)
    if info.shape != shape:
        raise ValueError(f"{name}: expected shape {shape} (num_layers * num_directions, N, "
                         f"size), got {info.shape}")
    infos.append(info)


def check_seq_lengths(seq_lengths, seq_len: int, batch: int):
    """int64 array of N lengths in 1..T, or None when absent or all equal to T."""
    if seq_lengths is None:
        return None
    try:
        lengths = np.asarray(seq_lengths)
    except Exception as exc:  # e.g. a ragged list
        raise TypeError(f"seq_lengths: expected N ints, got {seq_lengths!r}") from exc
    if lengths.dtype == bool or not np.issubdtype(lengths.dtype, np.integer):
        raise TypeError(f"seq_lengths: expected integers, got dtype {lengths.dtype}")
    if lengths.shape != (batch,):
        raise ValueError(f"seq_lengths: expected {batch} lengths (one per sequence), got "
                         f"shape {lengths.shape}")
    if lengths.min() < 1 or lengths.max() > seq_len:
        raise ValueError(f"seq_lengths: expected every length in 1..{seq_len} (T), got "
                         f"values from {lengths.min()} to {lengths.max()}")
    if (lengths == seq_len).all():
        return None
    return np.ascontiguousarray(lengths, dtype=np.int64)


def _config_tag(config: RNNConfig) -> float:
    return float(zlib.crc32(config.key().encode()) % (1 << 23))


def lengths_tag(lengths) -> float:
    """A small exact-in-float32 fingerprint of the lengths (0 when all are T)."""
    if lengths is None:
        return 0.0
    return float(zlib.crc32(lengths.tobytes()) % (1 << 23) + 1)


def _digits(value) -> list:
    """``value`` (below 2**30) as three base-1024 digits, most significant first: integers
    below 2048 are exact in float16, whose integers stop being exact at 2048."""
    value = int(value)
    return [float(value >> 20), float(value >> 10 & 1023), float(value & 1023)]


def _from_digits(digits) -> int:
    return (int(digits[0]) << 20) + (int(digits[1]) << 10) + int(digits[2])


def reserve_header(config, seq_len, batch, lengths, state) -> list:
    """The header a training forward writes: magic, state, then T, N, the config tag and
    the lengths tag as three digits each (slots 2-4, 5-7, 8-10, 11-13)."""
    return [RESERVE_MAGIC, state, *_digits(seq_len), *_digits(batch),
            *_digits(_config_tag(config)), *_digits(lengths_tag(lengths))]


def check_reserve(reserve, config, seq_len, batch, dtype, device, *, state=None,
                  lengths=None, inputs=()):
    """A reserve large enough (and, for backward, filled by a matching training forward in
    the expected ``state``)."""
    needed = rnn_reserve_layout(config, seq_len, batch).size
    if reserve is None:
        raise ValueError("reserve: expected the reserve of a training forward "
                         "(rnn_forward(..., training=True)), got None")
    info = inspect_array("reserve", reserve)
    if info.device != device:
        raise ValueError(f"reserve: expected an array on {device}, got one on {info.device}")
    if info.dtype != dtype:
        raise TypeError(f"reserve: expected dtype {dtype} like x, got {info.dtype}")
    if len(info.shape) != 1 or info.shape[0] < needed:
        raise ValueError(f"reserve: expected a 1-D array of at least {needed} elements "
                         f"(rnn_reserve_size(config, {seq_len}, {batch})), got shape "
                         f"{info.shape}")
    if device == "cpu":
        if not reserve.flags.writeable or not reserve.flags.c_contiguous:
            raise ValueError("reserve: expected a writable, contiguous array")
        for arr in inputs:
            if isinstance(arr, np.ndarray) and np.may_share_memory(reserve, arr):
                raise ValueError("reserve: expected memory separate from the other "
                                 "arrays, got one that overlaps an input")
    if state is None:
        return
    head = np.asarray(reserve[:RESERVE_HEADER]) if device == "cpu" else \
        reserve[:RESERVE_HEADER].copy_to_host()
    expected = reserve_header(config, seq_len, batch, lengths, state)
    if head[0] != RESERVE_MAGIC or head[1] not in (RESERVE_FORWARD, RESERVE_BACKWARD_DATA):
        raise ValueError("reserve: expected the reserve of a training forward "
                         "(rnn_forward(..., training=True)), got an array it did not fill")
    same = [bool(np.all(head[a:a + 3] == expected[a:a + 3])) for a in (2, 5, 8, 11)]
    if not all(same[:3]):
        other = "" if same[2] else ", another config"
        raise ValueError(f"reserve: filled by a training forward of another problem (T="
                         f"{_from_digits(head[2:5])}, N={_from_digits(head[5:8])}{other}), "
                         f"expected T={seq_len}, N={batch} and this config")
    if not same[3]:
        raise ValueError("seq_lengths: expected the lengths the training forward used, got "
                         "different ones")
    if head[1] != state:
        if state == RESERVE_FORWARD:
            raise ValueError("reserve: rnn_backward_data already ran on this reserve (it "
                             "overwrites the gate activations with their gradients, as "
                             "cuDNN does); run a new training forward")
        raise ValueError("reserve: expected rnn_backward_data to have run on this reserve "
                         "first (it writes the gate gradients rnn_backward_weights reads)")


def rnn_forward_problem(config, x, params, hx=None, cx=None, *, seq_lengths=None,
                        training=False, dropout_seed=None, reserve=None):
    """Validate :func:`numbaconv.rnn_forward`; returns ``(problem, lengths)``."""
    config = check_config(config)
    xinfo, t, n = _sequence("x", x, config, config.input_size)
    infos = [xinfo, _params_info(params, config)]
    ld = config.num_layers * config.num_directions
    _state("hx", hx, (ld, n, config.out_size), infos)
    _state("cx", cx, (ld, n, config.hidden_size), infos, config.mode == "lstm",
           f"for mode {config.mode!r} (cell states are LSTM only)")
    device, dtype = check_operands(*infos)
    training = _flag_value(training, "training")
    if dropout_seed is not None and (not isinstance(dropout_seed, (int, np.integer))
                                     or isinstance(dropout_seed, bool) or dropout_seed < 0):
        raise TypeError(f"dropout_seed: expected None or a non-negative int, got "
                        f"{dropout_seed!r}")
    lengths = check_seq_lengths(seq_lengths, t, n)
    if reserve is not None:
        if not training:
            raise ValueError("reserve: expected None with training=False (only the training "
                             "forward fills a reserve), got an array")
        check_reserve(reserve, config, t, n, dtype, device, inputs=(x, params, hx, cx))
    return RNNProblem("rnn_forward", config, t, n, dtype, device, training,
                      lengths is not None), lengths


def _params_info(params, config):
    info = inspect_array("params", params)
    if info.shape != (config.num_params,):
        raise ValueError(f"params: expected a 1-D array of {config.num_params} elements "
                         f"(config.num_params), got shape {info.shape}")
    return info


def rnn_backward_data_problem(config, y, dy, params, reserve, *, hx=None, cx=None, dhy=None,
                              dcy=None, seq_lengths=None):
    """Validate :func:`numbaconv.rnn_backward_data`; returns ``(problem, lengths)``."""
    config = check_config(config)
    features = config.num_directions * config.out_size
    yinfo, t, n = _sequence("y", y, config, features)
    dyinfo = inspect_array("dy", dy)
    if dyinfo.shape != yinfo.shape:
        raise ValueError(f"dy: expected y's shape {yinfo.shape}, got {dyinfo.shape}")
    infos = [yinfo, dyinfo, _params_info(params, config)]
    ld = config.num_layers * config.num_directions
    lstm = config.mode == "lstm"
    why = f"for mode {config.mode!r} (cell states are LSTM only)"
    _state("hx", hx, (ld, n, config.out_size), infos)
    _state("cx", cx, (ld, n, config.hidden_size), infos, lstm, why)
    _state("dhy", dhy, (ld, n, config.out_size), infos)
    _state("dcy", dcy, (ld, n, config.hidden_size), infos, lstm, why)
    device, dtype = check_operands(*infos)
    lengths = check_seq_lengths(seq_lengths, t, n)
    check_reserve(reserve, config, t, n, dtype, device, state=RESERVE_FORWARD,
                  lengths=lengths, inputs=(y, dy, params, hx, cx, dhy, dcy))
    return RNNProblem("rnn_backward_data", config, t, n, dtype, device, True,
                      lengths is not None), lengths


def rnn_backward_weights_problem(config, x, params, reserve, *, hx=None, seq_lengths=None,
                                 out=None, accumulate=False):
    """Validate :func:`numbaconv.rnn_backward_weights`; returns ``(problem, lengths)``."""
    config = check_config(config)
    xinfo, t, n = _sequence("x", x, config, config.input_size)
    infos = [xinfo, _params_info(params, config)]
    ld = config.num_layers * config.num_directions
    _state("hx", hx, (ld, n, config.out_size), infos)
    device, dtype = check_operands(*infos)
    lengths = check_seq_lengths(seq_lengths, t, n)
    check_reserve(reserve, config, t, n, dtype, device, state=RESERVE_BACKWARD_DATA,
                  lengths=lengths, inputs=(x, params, hx))
    check_out(out, (config.num_params,), device, dtype, accumulate, (x, params, hx, reserve))
    return RNNProblem("rnn_backward_weights", config, t, n, dtype, device, True,
                      lengths is not None, bool(accumulate)), lengths


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
