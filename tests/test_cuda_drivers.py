"""The convolution drivers' GPU path without a GPU: what each launch is handed.

On a GPU the drivers pass device pointers and integers to kernels compiled for one
signature each (numbaconv/cuda/_implicit_gemm.py ``_launch_types``, and the depthwise and
bias twins); under the simulator they pass arrays instead, so the simulator runs (tests/
test_cuda.py) never see the GPU path's argument lists. Here that path runs with the GPU
stood in (tests/gpu_standin.py: arrays that are only an address, a shape and strides;
kernels that are a name and a key; launches recorded): every launch of every op on the GPU
benchmark's layers and on small layers with every feature must match its kernel's
signature slot for slot (an address where it takes a pointer, a flag where a boolean, a
plain integer elsewhere), stay within the grid's limits and name the caller's arrays; and
a setup the drivers remember from one call must give a later call (same problem, other
arrays, other strides) exactly the launches a fresh one gives.
"""

import os
import subprocess
import sys

import pytest

pytest.importorskip("numba_cuda")

import numpy as np  # noqa: E402
from numba import types  # noqa: E402

import gpu_standin  # noqa: E402
from numbaconv import bench_cuda, dispatch  # noqa: E402
from numbaconv import problem as pb  # noqa: E402
from numbaconv.cuda import _bias, _depthwise, _implicit_gemm, _rnn_elementwise  # noqa: E402

OPS = ("conv", "conv_backward_data", "conv_backward_weight", "conv_backward_bias",
       "conv_transpose")

#: The GPU benchmark's layers, and small ones with the features those lack: 1D and 3D,
#: dilation, asymmetric padding, groups, a bias, each dtype.
LAYERS = [(c.name, (c.batch, c.in_channels) + (c.size,) * 2,
           c.weight_shape, dict(stride=c.stride, padding=c.padding, groups=c.groups),
           "float32") for c in bench_cuda.CASES] + [
    ("1d_dilated_grouped", (3, 6, 17), (4, 3, 3),
     dict(stride=2, padding=((2, 1),), dilation=2, groups=2), "float64"),
    ("3d_strided", (2, 4, 5, 6, 7), (6, 4, 3, 1, 2),
     dict(stride=(1, 2, 3), padding=1), "float16"),
    ("3d_depthwise", (2, 8, 4, 5, 6), (8, 1, 2, 3, 3),
     dict(stride=(2, 1, 1), padding=(0, 1, 1), dilation=(1, 2, 1), groups=8), "float32"),
]


@pytest.fixture
def gpu(monkeypatch):
    """The GPU stood in; yields the recorded launches."""
    with gpu_standin.standing_in(monkeypatch.setattr) as launches:
        yield launches


def physical(shape, layout):
    """A logical (N, C, *S) shape as the layout stores it."""
    if layout == "channels_last":
        return (shape[0],) + tuple(shape[2:]) + (shape[1],)
    return tuple(shape)


class Layer:
    """A layer's stand-in arrays in one layout, and each op's arguments on them."""

    def __init__(self, x_shape, w_shape, kwargs, dtype, layout, strided=False):
        self.kwargs, self.layout, self.dtype = dict(kwargs, layout=layout), layout, dtype
        self.w_shape, self.strided = w_shape, strided
        self.x = self.array(x_shape)
        y_shape = pb.conv_problem(self.x, self.array(w_shape, False), **self.kwargs).y_shape
        self.dy = self.array(y_shape, logical=False)
        self.w, self.bias = self.array(w_shape, False), self.array((w_shape[0],), False)
        self.bias_c = self.array((x_shape[1],), False)
        self.x_physical = physical(x_shape, layout)

    def array(self, shape, activation=True, logical=True):
        """A stand-in array; with ``strided``, each row padded by 3 elements (a view)."""
        if activation and logical:
            shape = physical(shape, self.layout)
        array = gpu_standin.DeviceArray(shape, self.dtype)
        if self.strided and len(shape) > 1:
            item = array.dtype.itemsize
            strides, step = [], item
            for i, n in enumerate(reversed(shape)):
                strides.append(step)
                step *= n + (3 if i == 0 else 0)
            array = gpu_standin.DeviceArray(shape, self.dtype, tuple(reversed(strides)))
        return array

    def call(self, op):
        """``(problem, operands, out)`` of ``op`` on these arrays (``out`` given)."""
        k = self.kwargs
        if op == "conv":
            problem = pb.conv_problem(self.x, self.w, self.bias, **k)
            return problem, (self.x, self.w, self.bias), self.array(problem.y_shape, False)
        if op == "conv_backward_data":
            problem = pb.conv_backward_data_problem(self.dy, self.w, self.x_physical, **k)
            return problem, (self.dy, self.w), self.array(self.x_physical, False)
        if op == "conv_transpose":
            problem = pb.conv_transpose_problem(self.dy, self.w, self.bias_c,
                                                **{n: v for n, v in k.items()})
            return problem, (self.dy, self.w, self.bias_c), \
                self.array(problem.x_shape, False)
        if op == "conv_backward_weight":
            problem = pb.conv_backward_weight_problem(self.x, self.dy, self.w_shape, **k)
            return problem, (self.x, self.dy), self.array(self.w_shape, False)
        problem = pb.conv_backward_bias_problem(self.dy, layout=self.layout)
        return problem, (self.dy,), self.array((problem.channels,), False)


def signature(kernel) -> tuple:
    """The argument types the kernel stood in for is compiled for."""
    name, key = kernel.name, kernel.key
    if name.startswith("rnn "):
        return _rnn_elementwise.launch_types(name[4:], key[0])
    if name == "bias_sums":
        return _bias.launch_types(key[0])
    if name.startswith("dw_"):
        return _depthwise._launch_types(name, key)
    return _implicit_gemm._launch_types(name, key)


def check_launch(launch):
    """Slot for slot against the kernel's signature, and within the grid's limits."""
    sig = signature(launch.kernel)
    what = f"{launch.kernel}: {launch.args}"
    assert len(launch.args) == len(sig), what
    for value, ty in zip(launch.args, sig):
        if isinstance(ty, types.CPointer):
            assert gpu_standin.is_address(value) or value == 0, what   # 0: no bias
        elif isinstance(ty, types.Boolean):
            assert isinstance(value, bool), what
        else:
            assert type(value) is int and not gpu_standin.is_address(value), what
    grid = launch.grid if isinstance(launch.grid, tuple) else (launch.grid,)
    assert 1 <= grid[0] < 2 ** 31 and all(1 <= g <= 65535 for g in grid[1:]), what
    assert 1 <= launch.block <= 1024, what


def algorithms(op, problem):
    return dispatch.get_backend("cuda").algorithms(op, problem)


def run(op, problem, operands, out, algorithm):
    return dispatch.get_backend("cuda").run(op, problem, operands, out, algorithm)


@pytest.mark.parametrize("layout", ["channels_first", "channels_last"])
@pytest.mark.parametrize("name, x_shape, w_shape, kwargs, dtype", LAYERS,
                         ids=[layer[0] for layer in LAYERS])
def test_every_launch_matches_its_kernels_signature(gpu, name, x_shape, w_shape, kwargs,
                                                    dtype, layout):
    """Every op and algorithm: each launch matches its kernel's signature, the caller's
    arrays are what the kernels read and write, indices are 32-bit, the result is ``out``."""
    layer = Layer(x_shape, w_shape, kwargs, dtype, layout)
    for op in OPS:
        problem, operands, out = layer.call(op)
        for algorithm in algorithms(op, problem):
            del gpu[:]
            assert run(op, problem, operands, out, algorithm) is out
            assert gpu, (op, algorithm)
            for launch in gpu:
                check_launch(launch)
            addresses = {a for launch in gpu for a in launch.args
                         if gpu_standin.is_address(a)}
            for array in operands + (out,):
                if array is not None:
                    assert array.address in addresses, (op, algorithm)
            assert not any(_wide(launch) for launch in gpu), (op, algorithm)


def _wide(launch) -> bool:
    """Whether the launch's kernel indexes in 64 bits."""
    name, key = launch.kernel.name, launch.kernel.key
    at = {"conv_gemm": 3, "weight_gemm": 2, "dw_conv": 4, "dw_weight": 3, "bias_sums": 3}
    return name in at and key[at[name]]


def launches(gpu, op, layer, algorithm) -> list:
    """The normalised launches of one call."""
    del gpu[:]
    problem, operands, out = layer.call(op)
    run(op, problem, operands, out, algorithm)
    addresses = {}
    return [launch.normalized(addresses) for launch in gpu]


@pytest.mark.parametrize("layout", ["channels_first", "channels_last"])
def test_a_remembered_setup_gives_a_fresh_ones_launches(gpu, layout):
    """A call after another of the same problem (its setup remembered) on other arrays,
    with other strides, launches exactly what it launches with every setup forgotten."""
    _, x_shape, w_shape, kwargs, dtype = LAYERS[-3]
    first = Layer(x_shape, w_shape, kwargs, dtype, layout)
    again = Layer(x_shape, w_shape, kwargs, dtype, layout, strided=True)
    for op in OPS:
        problem, _, _ = first.call(op)
        for algorithm in algorithms(op, problem):
            before = launches(gpu, op, first, algorithm)
            remembered = launches(gpu, op, again, algorithm)
            _implicit_gemm.forget_setups()
            fresh = launches(gpu, op, again, algorithm)
            assert remembered == fresh, (op, algorithm)
            assert remembered != before, (op, algorithm)   # the strides did change
            assert launches(gpu, op, first, algorithm) == before, (op, algorithm)


def test_the_host_path_script_times_every_op():
    """docs/benchmarks/cuda_host_path.py (numbaconv's own host time a call, the GPU stood
    in) runs: a row per layout and op of a layer, each op's launches counted."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = {k: v for k, v in os.environ.items() if k != "NUMBA_ENABLE_CUDASIM"}
    proc = subprocess.run([sys.executable, os.path.join("docs", "benchmarks",
                                                        "cuda_host_path.py"),
                           "--reps", "3", "--case", "depthwise"], cwd=root, env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    rows = [line.split() for line in proc.stdout.splitlines()
            if line.startswith("depthwise3x3_128c_56")]
    # the forward and data gradient one kernel, the gradients of w and b two each
    assert [(r[2], r[4]) for r in rows[:4]] == [
        ("conv", "1"), ("conv_backward_data", "1"), ("conv_backward_weight", "2"),
        ("conv_backward_bias", "2")], proc.stdout
    assert len(rows) == 8 and all(float(r[3]) > 0 for r in rows), proc.stdout


def test_tf32_steps_16_deep_on_the_largest_tile(gpu, monkeypatch):
    """With NUMBACONV_CUDA_TF32=1 on a tensor-core device, a forward that chooses the
    128x128 tile runs it 16 deep in both layouts (weights packed to 16-row steps); the
    weight gradient keeps 8, and so does every GEMM without TF32."""
    name, x_shape, w_shape, kwargs, dtype = LAYERS[4]
    assert name.startswith("pointwise_64to256")          # 256 rows: the 128x128 tile
    for tf32 in ("0", "1"):
        monkeypatch.setenv("NUMBACONV_CUDA_TF32", tf32)
        for layout in ("channels_first", "channels_last"):
            layer = Layer(x_shape, w_shape, kwargs, dtype, layout)
            for op in ("conv", "conv_backward_weight"):
                del gpu[:]
                problem, operands, out = layer.call(op)
                run(op, problem, operands, out, "implicit_gemm")
                [gemm] = [launch for launch in gpu if launch.kernel.name.endswith("_gemm")]
                tile = gemm.kernel.key[4 if op == "conv" else 3]
                deep = tf32 == "1" and op == "conv"
                assert tile.bk == (16 if deep else 8), (tf32, layout, op, tile)
                if op == "conv":
                    assert (tile.bm, tile.bn) == (128, 128), tile
                assert gemm.kernel.key[-1] == (tf32 == "1"), (tf32, layout, op)  # tc
                if op == "conv":   # the packed weights' reduction padded to the step
                    assert gemm.args[10] % tile.bk == 0 and gemm.args[10] >= 64


# --- the recurrent ops' element-wise kernels --------------------------------------------------

def _standin(shape, dtype, strides=None):
    """A stand-in array with element ``strides`` (negative ones allowed), its first element
    placed so that the lowest one it reaches is at its allocation's start."""
    item = np.dtype(dtype).itemsize
    plain = gpu_standin.DeviceArray(shape, dtype)
    if strides is None:
        return plain
    low = sum((n - 1) * s for n, s in zip(shape, strides) if s < 0)
    return gpu_standin.DeviceArray(shape, dtype, tuple(s * item for s in strides),
                                   plain.address - low * item)


def _element_address(array, index) -> int:
    return array.address + sum(i * s for i, s in zip(index, array.strides))


def test_rnn_elementwise_launches_address_every_element(gpu):
    """On the GPU path each element-wise launch matches its kernel's signature, and the
    offsets its arguments give (pointer + (base + i * stride ...) * item size) reach exactly
    each operand's elements, for negative strides, gaps, 1-D to 3-D arrays and the
    time/batch swap; an operand of another shape or dtype is refused before any launch."""
    dtype = "float32"
    item = 4
    out = _standin((2, 3, 4), dtype, (1, -8, 2))
    a = _standin((3, 2, 4), dtype, (-5, 40, 1))       # out's first two axes swapped
    b = _standin((2, 3, 4), dtype, (-12, 4, -1))
    for op, swap in (("add", True), ("copy", False), ("zero", False)):
        del gpu[:]
        _rnn_elementwise.apply(op, out, a if swap else b, b, swap=swap)
        [launch] = gpu
        check_launch(launch)
        assert launch.kernel.name == "rnn map3" and launch.kernel.key[2] == op
        args = launch.args
        count, s1, s2 = args[3:6]
        assert (count, s1, s2) == (24, 3, 4)
        operands = ((a if swap else b, args[0], args[6:10]), (b, args[1], args[10:14]),
                    (out, args[2], args[14:18]))
        for i in range(2):
            for k in range(3):
                for f in range(4):
                    for array, ref, (base, *strides) in operands:
                        at = (k, i, f) if array is a and swap else (i, k, f)
                        got = ref + (base + i * strides[0] + k * strides[1] +
                                     f * strides[2]) * item
                        assert got == _element_address(array, at), (op, array.shape)
    del gpu[:]
    lengths = gpu_standin.DeviceArray((5,), "int64")
    states = _standin((4, 5, 3), "float64", (-15, 3, 1))
    h0 = _standin((5, 3), "float64", (1, 5))
    prev = gpu_standin.DeviceArray((4, 5, 3), "float64")
    _rnn_elementwise.previous_states(states, h0, prev, lengths, True)
    [launch] = gpu
    check_launch(launch)
    args = launch.args
    y_base, y0, y1, y2, h_base, h0s, h1s = args[7:14]
    for t in range(4):
        for n in range(5):
            for j in range(3):
                assert args[0] + (y_base + t * y0 + n * y1 + j * y2) * 8 == \
                    _element_address(states, (t, n, j))
                assert args[1] + (h_base + n * h0s + j * h1s) * 8 == \
                    _element_address(h0, (n, j))
    assert args[2] == prev.address and args[3] == lengths.address
    del gpu[:]
    reserve = _standin((40,), "float16", (-2,))
    _rnn_elementwise.put(reserve, 3, [1737, 2, 0, 5])
    [launch] = gpu
    check_launch(launch)
    ref, base, step, count, *values = launch.args
    assert count == 4 and values == [1737, 2, 0, 5] + [0] * 12
    for e in range(4):
        assert ref + (base + e * step) * 2 == _element_address(reserve, (3 + e,))
    with pytest.raises(ValueError, match="put"):
        _rnn_elementwise.put(reserve, 38, [1, 2, 3])
    for bad in (_standin((2, 3, 5), dtype), _standin((2, 3, 4), "float64")):
        del gpu[:]
        with pytest.raises(ValueError, match="b: shape"):
            _rnn_elementwise.apply("add", out, out, bad)
        assert not gpu


def test_the_elementwise_launch_script_runs():
    """docs/benchmarks/rnn_elementwise_launch.py (an element-wise launch's host time, old
    Numba arguments against the short path's) runs and prints a row a launch."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = {k: v for k, v in os.environ.items() if k != "NUMBA_ENABLE_CUDASIM"}
    proc = subprocess.run([sys.executable, os.path.join("docs", "benchmarks",
                                                        "rnn_elementwise_launch.py"),
                           "--reps", "3"], cwd=root, env=env, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    rows = [line for line in proc.stdout.splitlines() if line.endswith(" us")]
    assert len(rows) == 4 and rows[0].startswith("copy"), proc.stdout


def test_rnn_bias_gradients_take_the_bias_gradients_two_passes(gpu):
    """``_bias.column_sums`` on a column slice of gate gradients (GRU's input-path columns
    3H:4H of a (T*N, 4H) matrix) launches the bias gradient's two kernels on it: the
    slice's first element, its columns as channels (stride 1), its rows as images (stride
    4H), and the sum of the chunks accumulating into ``out``."""
    rows, hs = 6, 3
    g = gpu_standin.DeviceArray((rows, 4 * hs), "float32")
    view = gpu_standin.DeviceArray((rows, hs), "float32", (4 * hs * 4, 4),
                                   g.address + 3 * hs * 4)
    out = gpu_standin.DeviceArray((hs,), "float32")
    _bias.column_sums(view, out, "float32", True, 256)
    sums, total = gpu
    for launch in gpu:
        check_launch(launch)
    assert sums.kernel.name == "bias_sums" and sums.args[0] == view.address
    assert sums.args[2:4] == (hs, rows)            # channels, rows
    assert sums.args[7:9] == (4 * hs, 1)            # the rows' stride, the columns'
    assert total.args[1] == out.address and total.args[2] == hs
    assert total.args[8] is True                     # accumulate
