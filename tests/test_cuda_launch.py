"""The cuda backend's short launch path (numbaconv/cuda/_launch.py) without a GPU.

What a GPU would show only as wrong results is checked here against Numba's own code: the
values the short path hands to cuda.core's ``launch`` for every signature the convolution
kernels are compiled for give the bytes Numba's ``_Kernel._prepare_args`` gives, and a
bound step launch replaces exactly the step's slot of Numba's converted arguments. Numba's
launch pieces are replaced by recorders (``_core``); the kernels, overloads and device
arrays by stand-ins with the attributes the module reads. The simulator runs (tests/
test_cuda.py) cover the other side: there every launch goes through ``kernel[grid, block]``.
"""

import ctypes

import numpy as np
import pytest

pytest.importorskip("numba_cuda")

from numba import types  # noqa: E402
from numba.cuda.dispatcher import _Kernel  # noqa: E402
from numba.cuda.errors import normalize_kernel_dimensions  # noqa: E402

from numbaconv.cuda import (_bias, _depthwise, _implicit_gemm, _launch,  # noqa: E402
                            _rnn_elementwise)
from numbaconv.cuda._implicit_gemm_kernels import TILES, TILES64  # noqa: E402


def param_bytes(value) -> bytes:
    """The bytes cuda.core's ParamHolder stores for one launch argument: a Python int
    (bools included) as an 8-byte intptr_t, a ctypes scalar as its own bytes."""
    if isinstance(value, ctypes._SimpleCData):
        return bytes(value)
    assert isinstance(value, int), value
    return int(value).to_bytes(8, "little", signed=True)


def numba_arguments(argument_types, values):
    """What Numba's ``_Kernel.launch`` passes to cuda.core for these scalar arguments."""
    class Overload:
        extensions = []
    out, kept = [], []
    for ty, value in zip(argument_types, values):
        _Kernel._prepare_args(Overload(), ty, value, 0, kept, out)
    assert not kept
    return out


def conv_signatures():
    """Every (name, argument types) the GEMM, depthwise and bias paths compile their kernels
    for, and the recurrent ops' element-wise kernels (which launch the same way)."""
    for dtype in ("float16", "float32", "float64"):
        tile = (TILES64 if dtype == "float64" else TILES)[0]
        for wide in (False, True):
            yield "conv_gemm", _implicit_gemm._launch_types(
                "conv_gemm", (dtype, False, 2, wide, tile, True, False))
            yield "weight_gemm", _implicit_gemm._launch_types(
                "weight_gemm", (dtype, 2, wide, tile))
        for name in ("pack_weights", "sum_chunks"):
            yield name, _implicit_gemm._launch_types(name, (dtype,))
        for name in ("dw_conv", "dw_weight"):
            yield name, _depthwise._launch_types(name, (dtype,))
        yield "bias_sums", _bias.launch_types(dtype)
        for name in ("map3", "previous_states", "put"):
            yield f"rnn {name}", _rnn_elementwise.launch_types(name, dtype)


SAMPLES = (0, 1, -1, 7, -(2 ** 40) - 3, 2 ** 47 + 4096, 2 ** 63 - 1, -(2 ** 63), True, False,
           np.int32(-5), np.int64(2 ** 33), np.uint32(4_000_000_000), np.bool_(True),
           np.intp(12))


@pytest.mark.parametrize("name, argument_types", list(conv_signatures()),
                         ids=lambda v: v if isinstance(v, str) else "")
def test_the_short_path_gives_numbas_bytes_for_every_conv_signature(name, argument_types):
    """Every signature qualifies for the short path (a pointer, a 64-bit integer or a
    flag), and for sample values of each (signed extremes, NumPy integers of other widths,
    NumPy and Python bools) the short path's arguments are byte for byte Numba's."""
    assert _launch.integer_types(argument_types), name
    for shift in range(len(SAMPLES)):
        values = [SAMPLES[(i + shift) % len(SAMPLES)] for i in range(len(argument_types))]
        for i, ty in enumerate(argument_types):
            if isinstance(ty, types.Boolean):
                values[i] = bool(values[i])
            elif isinstance(ty, types.CPointer):  # a device address
                values[i] = abs(int(values[i])) % 2 ** 62
            elif isinstance(values[i], np.bool_):  # Numba's c_int64 refuses one
                values[i] = np.int8(values[i])
        ours = [v if type(v) is int else _launch.integer(v) for v in values]
        theirs = numba_arguments(argument_types, values)
        assert [param_bytes(v) for v in ours] == [param_bytes(v) for v in theirs], name


def test_other_argument_types_keep_numbas_launch():
    """A 32-bit integer, a float or an array argument is not one the short path passes."""
    assert _launch.integer_types((types.CPointer(types.float32), types.int64, types.boolean,
                                  types.uint64))
    for other in (types.int32, types.float32, types.float64, types.float32[:]):
        assert not _launch.integer_types((types.int64, other)), other


@pytest.mark.parametrize("value", [1.0, np.float32(2), "3", None, 2 + 0j])
def test_a_non_integer_argument_is_refused(value):
    with pytest.raises(TypeError, match="expected an integer"):
        _launch.integer(value)


def test_numba_cudas_launch_pieces_are_where_the_short_path_reads_them():
    """On the numba-cuda installed here, ``_core`` finds cuda.core's launch and the rest
    (else the short path would silently never apply), and builds the configuration Numba
    would: dimensions normalised, no dynamic shared memory, not cooperative."""
    core = _launch._core()
    assert core is not None
    config = core.config((3, 2), 64)
    assert (tuple(config.grid), tuple(config.block), config.shmem_size) == \
        ((3, 2, 1), (64, 1, 1), 0)


# --- the launch paths, with Numba's launch replaced by recorders ---------------------------

class Recorder:
    """Stands in for numba-cuda's launch pieces (what ``_launch._core`` returns)."""

    def __init__(self):
        self.launches, self.configs, self.streams = [], [], 0

    def core(self):
        rec = self

        def launch(stream, config, kernel, *args):
            rec.launches.append((stream, config, kernel, list(args)))

        def launch_config(**kw):
            rec.configs.append(kw)
            return ("config", kw["grid"], kw["block"])
        def stream(handle):
            rec.streams += 1
            return ("stream", handle)
        return _launch._Core(launch, launch_config, stream, normalize_kernel_dimensions,
                             "is_cooperative")


class Overload:
    """The attributes of a compiled ``_Kernel`` the short path reads."""

    cooperative = debug = launch_config_sensitive = False
    extensions = ()
    entry_name = "stand_in"

    def __init__(self, argument_types):
        self.argument_types = argument_types
        self.load("core kernel")

    def load(self, name):
        """The function loaded on "the current device" becomes ``name``."""
        cufunc = type("Cufunc", (), {"kernel": name})()
        self._codelibrary = type("Library", (), {"get_cufunc": lambda _: cufunc})()

    def _prepare_args(self, ty, value, stream, kept, out):
        """Numba's conversion, with a device array as Numba expands it (meminfo, parent,
        size, itemsize, pointer, shape, byte strides); a host array is 'copied'."""
        if isinstance(ty, types.Array):
            if isinstance(value, np.ndarray):  # Numba would copy it to the device
                kept.append(value)
                value = DeviceArray(1 << 20, value.shape)
            out += [0, 0, value.size, value.itemsize, value.ptr, *value.shape,
                    *value.strides]
            return
        _Kernel._prepare_args(self, ty, value, stream, kept, out)


class Kernel:
    """A dispatcher: ``kernel[grid, block](*args)`` records a launch through Numba."""

    _launch_config_sensitive = False

    def __init__(self, *argument_types, overloads=1):
        self.overload = Overload(argument_types)
        self.overloads = {(argument_types, i): self.overload for i in range(overloads)}
        self.numba_launches = []

    def __getitem__(self, config):
        return lambda *args: self.numba_launches.append((config, list(args)))

    def typeof_pyval(self, value):
        if isinstance(value, DeviceArray):
            return types.float32[:, :]
        return types.boolean if isinstance(value, bool) else types.int64


class DeviceArray:
    def __init__(self, ptr, shape):
        self.ptr, self.shape, self.itemsize = ptr, shape, 4
        self.size = int(np.prod(shape))
        self.strides = (4 * shape[1], 4)


@pytest.fixture
def recorder(monkeypatch):
    rec = Recorder()
    monkeypatch.setattr(_launch, "_core", rec.core)
    monkeypatch.setattr(_launch, "simulated", lambda: False)
    monkeypatch.setattr(_launch, "_PLANS", {})
    monkeypatch.delenv("NUMBACONV_CUDA_SHORT_LAUNCH", raising=False)
    return rec


def test_launch_goes_through_numba_once_then_passes_ints(recorder):
    """The first launch of a kernel is Numba's; later ones hand cuda.core the legacy default
    stream (built again only when the current device's function changes), numba-cuda's
    configuration of (grid, block) (built once per pair) and the arguments as ints."""
    kernel = Kernel(types.CPointer(types.float32), types.int64, types.boolean)
    _launch.launch(kernel, (3, 2), 64, 1 << 40, np.int32(-3), True)
    assert kernel.numba_launches == [(((3, 2), 64), [1 << 40, np.int32(-3), True])]
    assert recorder.launches == []
    _launch.launch(kernel, (3, 2), 64, 1 << 41, np.int64(5), np.bool_(False))
    _launch.launch(kernel, (3, 2), 64, 8, 9, True)
    _launch.launch(kernel, 5, (32, 4), 8, 9, True)
    assert len(kernel.numba_launches) == 1
    config = ("config", (3, 2, 1), (64, 1, 1))
    assert recorder.launches[:2] == [(("stream", 0), config, "core kernel", [1 << 41, 5, 0]),
                                     (("stream", 0), config, "core kernel", [8, 9, 1])]
    assert all(type(v) is int for _, _, _, args in recorder.launches for v in args)
    assert recorder.launches[2][1] == ("config", (5, 1, 1), (32, 4, 1))
    assert recorder.configs == [dict(grid=(3, 2, 1), block=(64, 1, 1), shmem_size=0,
                                     is_cooperative=False),
                                dict(grid=(5, 1, 1), block=(32, 4, 1), shmem_size=0,
                                     is_cooperative=False)]
    assert recorder.streams == 1  # kept while the device is the same
    kernel.overload.load("on another device")
    _launch.launch(kernel, 5, (32, 4), 8, 9, True)
    assert recorder.launches[-1][2] == "on another device" and recorder.streams == 2
    with pytest.raises(TypeError, match="2 arguments, expected 3"):
        _launch.launch(kernel, (3, 2), 64, 1, 2)
    with pytest.raises(TypeError, match="expected an integer"):
        _launch.launch(kernel, (3, 2), 64, 1, 2.5, True)


@pytest.mark.parametrize("why", ["float argument", "two overloads", "cooperative", "debug",
                                 "extension", "launch-config sensitive", "no numba-cuda",
                                 "switched off"])
def test_launch_keeps_numbas_path_where_the_short_one_does_not_apply(recorder, monkeypatch,
                                                                      why):
    kernel = Kernel(types.CPointer(types.float32),
                    types.float32 if why == "float argument" else types.int64,
                    overloads=2 if why == "two overloads" else 1)
    setattr(kernel.overload, "cooperative", why == "cooperative")
    setattr(kernel.overload, "debug", why == "debug")
    setattr(kernel.overload, "extensions", ["x"] if why == "extension" else [])
    kernel._launch_config_sensitive = why == "launch-config sensitive"
    if why == "no numba-cuda":
        monkeypatch.setattr(_launch, "_core", lambda: None)
    if why == "switched off":
        monkeypatch.setenv("NUMBACONV_CUDA_SHORT_LAUNCH", "0")
    for i in range(3):
        _launch.launch(kernel, 4, 32, 1 << 40, i)
    assert len(kernel.numba_launches) == 3 and recorder.launches == []


def test_a_bound_launch_replaces_only_the_step(recorder):
    """``Bound``: the first step through Numba (with the step's value in place), then
    Numba's conversion of those arguments with only the step's slot replaced, in the ctypes
    type Numba gave it; the arrays before it take several slots each."""
    a, b = DeviceArray(1 << 36, (4, 6)), DeviceArray(1 << 37, (2, 3))
    kernel = Kernel(types.float32[:, :], types.float32[:, :], types.int64, types.boolean)
    bound = _launch.Bound(kernel, 7, 32, (a, b, 0, True), at=2)
    for t in (5, 4, 3):
        bound(t)
    assert kernel.numba_launches == [((7, 32), [a, b, 5, True])]
    expanded = [0, 0, 24, 4, 1 << 36, 4, 6, 24, 4, 0, 0, 6, 4, 1 << 37, 2, 3, 12, 4]
    assert len(recorder.launches) == 2
    for (stream, config, core_kernel, args), t in zip(recorder.launches, (4, 3)):
        assert (stream, config, core_kernel) == (("stream", 0), ("config", (7, 1, 1),
                                                                  (32, 1, 1)), "core kernel")
        assert args[:18] == expanded and args[19] is True
        assert type(args[18]) is ctypes.c_int64 and args[18].value == t


@pytest.mark.parametrize("why", ["host array", "step not an integer", "simulator",
                                 "switched off"])
def test_a_bound_launch_keeps_numbas_path_where_it_must(recorder, monkeypatch, why):
    """A host array (Numba copies it over at every launch), a step argument that is not one
    integer slot, the simulator, or the switch off: every step through Numba, with the step
    set."""
    if why == "simulator":
        monkeypatch.setattr(_launch, "simulated", lambda: True)
    if why == "switched off":
        monkeypatch.setenv("NUMBACONV_CUDA_SHORT_LAUNCH", "0")
    a = np.zeros((2, 3), np.float32) if why == "host array" else DeviceArray(64, (2, 3))
    step_type = types.float64 if why == "step not an integer" else types.int64
    kernel = Kernel(types.float32[:, :], step_type)
    bound = _launch.Bound(kernel, 1, 32, (a, 0), at=1)
    for t in range(3):
        bound(t)
    assert [args[1] for _, args in kernel.numba_launches] == [0, 1, 2]
    assert recorder.launches == []
