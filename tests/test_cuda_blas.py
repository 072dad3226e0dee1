"""The cuda recurrent ops' product interface (numbaconv/cuda/_blas.py) without a GPU or the
simulator: the NumPy stand-in for cuBLAS against np.matmul, the mapping of row-major arrays
onto column-major cuBLAS calls (run on host arrays through the stand-in), the launch grids
against the hardware's limits, and how the binding is chosen."""

import numpy as np
import pytest

import cublas_standin
from cublas_standin import OP_N, OP_T, CublasError, Memory, StandIn
from numbaconv.config import CUDA_TILE
from numbaconv.cuda import _blas, _rnn_kernels


def standin_binding(memory):
    s = StandIn(memory)
    return s, _blas.Cublas("a NumPy stand-in", s.sgemm, s.dgemm, s.create, s.set_stream,
                           s.set_math_mode, OP_N, OP_T, cublas_standin.DEFAULT_MATH,
                           cublas_standin.TF32_TENSOR_OP_MATH)


def scalar(value, dtype):
    """A host scalar and its address (kept alive by the caller)."""
    a = np.array([value], dtype)
    return a, a.ctypes.data


# --- the stand-in itself -------------------------------------------------------------------

@pytest.mark.parametrize("dtype", ["float32", "float64"])
@pytest.mark.parametrize("transa, transb", [(OP_N, OP_N), (OP_N, OP_T), (OP_T, OP_N),
                                            (OP_T, OP_T)])
def test_standin_is_column_major_gemm(dtype, transa, transb):
    """Hand-made column-major operands (Fortran order, inside larger buffers so that the
    leading dimensions exceed the rows): C = alpha op(A) op(B) + beta C, as np.matmul."""
    rng = np.random.default_rng(0)
    m, n, k = 3, 4, 5
    a_rows, a_cols = (m, k) if transa == OP_N else (k, m)
    b_rows, b_cols = (k, n) if transb == OP_N else (n, k)
    a_buf = np.asfortranarray(rng.standard_normal((a_rows + 2, a_cols)).astype(dtype))
    b_buf = np.asfortranarray(rng.standard_normal((b_rows + 1, b_cols)).astype(dtype))
    c_buf = np.asfortranarray(rng.standard_normal((m + 3, n)).astype(dtype))
    c_before = c_buf.copy()
    memory = Memory()
    for buf in (a_buf, b_buf, c_buf):
        memory.register(buf)
    standin = StandIn(memory)
    handle = standin.create()
    standin.set_stream(handle, 0)
    alpha, alpha_p = scalar(2.0, dtype)
    beta, beta_p = scalar(0.5, dtype)
    gemm = standin.sgemm if dtype == "float32" else standin.dgemm
    gemm(handle, transa, transb, m, n, k, alpha_p, a_buf.ctypes.data, a_rows + 2, b_buf.ctypes.data,
         b_rows + 1, beta_p, c_buf.ctypes.data, m + 3)
    a = a_buf[:a_rows] if transa == OP_N else a_buf[:a_rows].T
    b = b_buf[:b_rows] if transb == OP_N else b_buf[:b_rows].T
    want = 2.0 * np.matmul(a.astype(np.float64), b.astype(np.float64)) + 0.5 * c_before[:m]
    tol = 1e-5 if dtype == "float32" else 1e-12
    assert np.allclose(c_buf[:m], want, rtol=tol, atol=tol)
    assert np.array_equal(c_buf[m:], c_before[m:])  # rows past m (inside ldc) untouched
    assert standin.calls == [(dtype, transa, transb, m, n, k, a_rows + 2, b_rows + 1, m + 3,
                              2.0, 0.5)]


def test_standin_ignores_c_when_beta_is_zero_and_checks_its_arguments():
    memory = Memory()
    a = np.asfortranarray(np.ones((2, 2)))
    c = np.asfortranarray(np.full((2, 2), np.nan))
    memory.register(a)
    memory.register(c)
    standin = StandIn(memory)
    handle = standin.create()
    standin.set_stream(handle, 0)
    one, one_p = scalar(1.0, "float64")
    zero, zero_p = scalar(0.0, "float64")
    p = a.ctypes.data
    standin.dgemm(handle, OP_N, OP_N, 2, 2, 2, one_p, p, 2, p, 2, zero_p, c.ctypes.data, 2)
    assert np.array_equal(c, np.full((2, 2), 2.0))
    with pytest.raises(CublasError, match="lda"):
        standin.dgemm(handle, OP_N, OP_N, 2, 2, 2, one_p, p, 1, p, 2, zero_p, c.ctypes.data,
                      2)
    with pytest.raises(CublasError, match="outside"):  # a matrix past the buffer's end
        standin.dgemm(handle, OP_N, OP_N, 2, 2, 2, one_p, p, 3, p, 2, zero_p, c.ctypes.data,
                      2)


# --- the mapping ---------------------------------------------------------------------------

def layouts(rows, cols, rng, dtype):
    """A (rows, cols) array in several memory layouts: {name: (array, its buffer)}."""
    values = rng.standard_normal((rows, cols)).astype(dtype)
    found = {}
    found["row-major"] = values.copy()
    found["column-major"] = np.asfortranarray(values)
    wide = np.zeros((rows, cols + 3), dtype)  # rows further apart than the columns
    wide[:, 2:2 + cols] = values
    found["row-major slice"] = wide[:, 2:2 + cols]
    tall = np.zeros((cols, rows + 2), dtype)  # a transposed view of a row-major slice
    tall[:, 1:1 + rows] = values.T
    found["transposed slice"] = tall[:, 1:1 + rows].T
    sparse = np.zeros((rows, 2 * cols), dtype)  # no unit stride: the Numba kernel's
    sparse[:, ::2] = values
    found["strided"] = sparse[:, ::2]
    return found


EXPRESSIBLE = ("row-major", "column-major", "row-major slice", "transposed slice")


@pytest.mark.parametrize("dtype", ["float32", "float64"])
@pytest.mark.parametrize("ta, tb", [(False, False), (False, True), (True, False),
                                    (True, True)])
@pytest.mark.parametrize("accumulate", [False, True])
def test_mapping_matches_matmul_for_every_layout(dtype, ta, tb, accumulate):
    """c (+)= op(a) @ op(b) for every combination of operand layouts, through the stand-in;
    layouts cuBLAS cannot address are declined (False), and c is then untouched."""
    rng = np.random.default_rng(1)
    m, q, k = 5, 3, 4
    a_shape = (k, m) if ta else (m, k)
    b_shape = (q, k) if tb else (k, q)
    for a_name, (a) in layouts(*a_shape, rng, dtype).items():
        for b_name, b in layouts(*b_shape, rng, dtype).items():
            for c_name, c in layouts(m, q, rng, dtype).items():
                memory = Memory()
                for array in (a, b, c):
                    memory.register(array)
                standin, binding = standin_binding(memory)
                handle = standin.create()
                standin.set_stream(handle, 0)
                before = c.copy()
                done = _blas.cublas_product(binding, handle, a, b, c, dtype, ta=ta, tb=tb,
                                            accumulate=accumulate)
                names = (a_name, b_name, c_name)
                if not all(name in EXPRESSIBLE for name in names):
                    assert not done and np.array_equal(c, before), names
                    continue
                assert done and len(standin.calls) == 1, names
                op_a = a.T if ta else a
                op_b = b.T if tb else b
                want = np.matmul(op_a.astype(np.float64), op_b.astype(np.float64))
                if accumulate:
                    want += before
                tol = 1e-5 if dtype == "float32" else 1e-12
                assert np.allclose(c, want, rtol=tol, atol=tol), names
                assert standin.calls[0][-1] == (1.0 if accumulate else 0.0)


#: Every product the recurrent ops make, as (what, a, b, c, ta, tb) with shapes and row
#: strides of views into their buffers: (rows, cols, row stride, column offset). T=3, N=2,
#: I=4, H=5, P=3 (projection), GRU's 4H-wide gate rows, LSTM's 4H.
T_, N_, I_, H_, P_ = 3, 2, 4, 5, 3
RNN_CALLS = [
    ("input projection (GRU: 3H of 4H columns)", (T_ * N_, I_, I_, 0), (3 * H_, I_, I_, 0),
     (T_ * N_, 3 * H_, 4 * H_, 0), False, True),
    ("recurrent product", (N_, H_, H_, 0), (4 * H_, H_, H_, 0), (N_, 4 * H_, 4 * H_, 0),
     False, True),
    ("projection m @ W_hr.T", (N_, H_, H_, 0), (P_, H_, H_, 0), (N_, P_, P_, 0), False,
     True),
    ("dproj @ W_hr", (N_, P_, P_, 0), (P_, H_, H_, 0), (N_, H_, H_, 0), False, False),
    ("GRU dgates[:, :3H] @ W_hh", (N_, 3 * H_, 4 * H_, 0), (3 * H_, H_, H_, 0),
     (N_, H_, H_, 0), False, False),
    ("input gradient, GRU dn columns", (T_ * N_, H_, 4 * H_, 3 * H_), (H_, I_, I_, 0),
     (T_ * N_, I_, I_, 0), False, False),
    ("input gradient, one direction's output columns", (T_ * N_, 4 * H_, 4 * H_, 0),
     (4 * H_, 2 * P_, 2 * P_, 0), (T_ * N_, 2 * P_, 2 * P_, 0), False, False),
    ("weight gradient dgates.T @ x", (T_ * N_, 4 * H_, 4 * H_, 0), (T_ * N_, I_, I_, 0),
     (4 * H_, I_, I_, 0), True, False),
    ("weight gradient of a layer > 0 reading one direction's outputs",
     (T_ * N_, 3 * H_, 4 * H_, 0), (T_ * N_, P_, 2 * P_, P_), (3 * H_, P_, P_, 0), True,
     False),
    ("dW_hr = dproj.T @ m", (T_ * N_, P_, P_, 0), (T_ * N_, H_, H_, 0), (P_, H_, H_, 0),
     True, False),
]


def strided_view(rng, rows, cols, row_stride, offset, dtype):
    buffer = rng.standard_normal(rows * row_stride + offset + cols).astype(dtype)
    view = np.lib.stride_tricks.as_strided(
        buffer[offset:], shape=(rows, cols),
        strides=(row_stride * buffer.itemsize, buffer.itemsize))
    return view, buffer


@pytest.mark.parametrize("what, a_spec, b_spec, c_spec, ta, tb", RNN_CALLS,
                         ids=[c[0] for c in RNN_CALLS])
@pytest.mark.parametrize("accumulate", [False, True])
def test_every_rnn_call_shape(what, a_spec, b_spec, c_spec, ta, tb, accumulate):
    rng = np.random.default_rng(2)
    memory = Memory()
    views = []
    for spec in (a_spec, b_spec, c_spec):
        view, buffer = strided_view(rng, *spec, "float64")
        memory.register(buffer)
        views.append((view, buffer))
    (a, _), (b, _), (c, c_buffer) = views
    outside = c_buffer.copy()
    before = c.copy()
    standin, binding = standin_binding(memory)
    handle = standin.create()
    standin.set_stream(handle, 0)
    assert _blas.cublas_product(binding, handle, a, b, c, "float64", ta=ta, tb=tb,
                                accumulate=accumulate)
    want = (a.T if ta else a) @ (b.T if tb else b) + (before if accumulate else 0)
    assert np.allclose(c, want, rtol=1e-12, atol=1e-12)
    # Nothing outside c's elements changed (the rows' gaps, the buffer's ends).
    mask = np.ones(c_buffer.shape, bool)
    rows, cols, stride, offset = c_spec
    for r in range(rows):
        mask[offset + r * stride:offset + r * stride + cols] = False
    assert np.array_equal(c_buffer[mask], outside[mask])


def test_plan_swaps_operands_for_row_major_outputs():
    """c (2x3, row-major) = a (2x4) @ b (4x3): cuBLAS computes c^T = b^T a^T, m = 3, n = 2,
    k = 4, both operands read as stored (their row-major memory is already the transpose)."""
    call = _blas.plan((2, 4), (4, 1), (4, 3), (3, 1), (2, 3), (3, 1), False, False)
    assert call == _blas.Call(False, False, 3, 2, 4, "b", 3, "a", 4, 3)
    # b given as (3, 4) with tb: cuBLAS transposes its stored view.
    call = _blas.plan((2, 4), (4, 1), (3, 4), (4, 1), (2, 3), (3, 1), False, True)
    assert call == _blas.Call(True, False, 3, 2, 4, "b", 4, "a", 4, 3)
    # no unit stride: declined
    assert _blas.plan((2, 4), (8, 2), (4, 3), (3, 1), (2, 3), (3, 1), False, False) is None
    assert _blas.column_major((1, 5), (99, 1)) == (5, True)
    assert _blas.column_major((5, 1), (1, 77)) == (1, True)


def test_float16_and_empty_reductions_are_left_to_the_numba_kernel():
    memory = Memory()
    standin, binding = standin_binding(memory)
    a = np.ones((2, 2), np.float16)
    assert not _blas.cublas_product(binding, 1, a, a, a.copy(), "float16")
    assert standin.calls == []


# --- grids ---------------------------------------------------------------------------------

def within_limits(grid):
    grid = (grid,) if isinstance(grid, int) else tuple(grid)
    return 1 <= grid[0] <= _blas.MAX_GRID_X and all(1 <= g <= _blas.MAX_GRID_YZ
                                                    for g in grid[1:])


@pytest.mark.parametrize("t_len, n", [(1024, 1024), (4096, 2048), (1, 1)])
@pytest.mark.parametrize("tile", [CUDA_TILE, (4, 8, 4)])
def test_grids_stay_within_the_hardware_limits(t_len, n, tile):
    """The grids of every launch an LSTM/GRU of I = H = 1024 (P = 512 with projection)
    makes at T x N up to 4096 x 2048 (8M rows: 131,072 row tiles of 64, twice the y limit
    the row tiles used to be on), and that every output tile is visited: the kernel loops
    over the tiles past the grid."""
    i, h, p, gates = 1024, 1024, 512, 4
    rows = t_len * n
    products = [(rows, gates * h), (n, gates * h), (n, p), (n, h), (rows, i),
                (gates * h, i), (gates * h, h), (p, h)]
    for out_rows, out_cols in products:
        grid, block = _blas.gemm_launch(out_rows, out_cols, tile)
        assert within_limits(grid), (out_rows, out_cols, grid)
        assert block == (tile[1], tile[0]) and block[0] * block[1] <= 1024
        bm, bq = _rnn_kernels.block_tile(tile)   # the outputs a block computes
        row_tiles, col_tiles = -(-out_rows // bm), -(-out_cols // bq)
        assert grid[0] == min(row_tiles, _blas.MAX_GRID_X)
        assert grid[1] == min(col_tiles, _blas.MAX_GRID_YZ)
    for count in (rows * h, rows * p, n * h, gates * h, rows * 2 * p):
        grid, threads = _blas.elementwise_launch(count, 256)
        assert within_limits(grid) and grid * threads >= count


def test_the_old_grid_would_have_failed_at_t_n_1024():
    """Rows on y (the former launch): 1024 * 1024 rows in tiles of 16 (one output a thread,
    as then) needed 65,536 blocks, one more than y holds; on x they fit (in tiles of 32 now,
    2x2 outputs a thread)."""
    assert -(-1024 * 1024 // CUDA_TILE[0]) > _blas.MAX_GRID_YZ
    grid, _ = _blas.gemm_launch(1024 * 1024, 4 * 512, CUDA_TILE)
    assert _rnn_kernels.block_tile(CUDA_TILE) == (32, 32)
    assert grid == (32768, 64)
    with pytest.raises(ValueError, match="more than a grid holds"):
        _blas.elementwise_launch(2**31 * 256, 256)


# --- which binding -------------------------------------------------------------------------

def test_describe_loads_nothing_and_follows_the_switch(monkeypatch):
    monkeypatch.setattr(_blas, "_state", None)
    monkeypatch.setenv("NUMBACONV_CUDA_CUBLAS", "0")
    assert "NUMBACONV_CUDA_CUBLAS=0" in _blas.describe()
    assert _blas.binding() == (None, "the Numba gemm kernel (NUMBACONV_CUDA_CUBLAS=0)")
    monkeypatch.setattr(_blas, "_state", None)
    monkeypatch.delenv("NUMBACONV_CUDA_CUBLAS")
    text = _blas.describe()
    assert "Numba gemm kernel" in text
    assert _blas._state is None


def test_a_binding_that_fails_to_load_falls_back_and_is_remembered(monkeypatch):
    calls = []

    def broken():
        calls.append(1)
        raise OSError("libcublas.so.12: cannot open shared object file")

    monkeypatch.setattr(_blas, "_state", None)
    monkeypatch.delenv("NUMBACONV_CUDA_CUBLAS", raising=False)
    monkeypatch.setattr(_blas, "_simulated", lambda: False)
    monkeypatch.setattr(_blas, "BINDINGS", (("nvmath-python", "numpy", broken),
                                            ("CuPy", "no_such_module_here", broken)))
    binding, why = _blas.binding()
    assert binding is None
    assert "libcublas.so.12" in why and "CuPy is not installed" in why
    assert _blas.binding() == (None, why) and calls == [1]  # looked for once


def test_handles_are_per_thread_and_follow_tf32(monkeypatch):
    """One handle per (device, thread, TF32 setting), on the stream Numba's kernels use,
    with cuBLAS's default math unless NUMBACONV_CUDA_TF32=1."""
    import threading
    memory = Memory()
    standin, binding = standin_binding(memory)
    monkeypatch.setattr(_blas, "_device_id", lambda: 0)
    monkeypatch.setattr(_blas, "_stream_handle", lambda: 0)
    previous = _blas.set_binding(binding)
    try:
        first = _blas.handle(binding, False)
        assert _blas.handle(binding, False) == first
        tf32 = _blas.handle(binding, True)
        assert tf32 != first
        assert standin.math_modes == {first: cublas_standin.DEFAULT_MATH,
                                      tf32: cublas_standin.TF32_TENSOR_OP_MATH}
        other = []
        thread = threading.Thread(target=lambda: other.append(_blas.handle(binding, False)))
        thread.start()
        thread.join()
        assert other[0] not in (first, tf32)
        assert set(standin.streams.values()) == {0}
    finally:
        _blas.restore(previous)
    monkeypatch.setenv("NUMBACONV_CUDA_TF32", "1")
    from numbaconv import config
    assert config.cuda_tf32()
    monkeypatch.setenv("NUMBACONV_CUDA_TF32", "yes")
    with pytest.raises(ValueError):
        config.cuda_tf32()


def test_info_names_the_product_path(capsys, monkeypatch):
    from numbaconv.cli import main
    monkeypatch.setattr(_blas, "_state", None)
    monkeypatch.setenv("NUMBACONV_CUDA_CUBLAS", "0")
    assert main(["info"]) == 0
    out = capsys.readouterr().out
    assert "  RNN products  the Numba gemm kernel (NUMBACONV_CUDA_CUBLAS=0)" in out
    assert _blas._state is None  # info loaded nothing


def test_importing_numbaconv_loads_no_binding():
    import subprocess
    import sys
    code = ("import sys, numbaconv, numbaconv.cuda._blas; "
            "assert not [m for m in sys.modules if m.startswith(('nvmath', 'cupy'))], "
            "sorted(sys.modules)")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


def test_a_prepared_product_replays_one_call_and_moves_to_each_step(monkeypatch):
    """Prepared (the step loops' recurrent products): the same cuBLAS call each run, with
    a's pointer moved to the step's operand (no slice made); a ``steps`` array whose step 0
    is not a is refused."""
    rng = np.random.default_rng(3)
    gates = rng.standard_normal((4, 2, 8))  # (T, N, 4H) reserve gates, H = 2
    w_hh = rng.standard_normal((6, 3))      # the GRU's 3H rows of W_hh, P = 3
    rec = np.zeros((2, 3))
    memory = Memory()
    for array in (gates, w_hh, rec):
        memory.register(array)
    standin, binding = standin_binding(memory)
    monkeypatch.setattr(_blas, "_device_id", lambda: 0)
    monkeypatch.setattr(_blas, "_stream_handle", lambda: 0)
    previous = _blas.set_binding(binding)
    try:
        prepared = _blas.Prepared(gates[0][:, :6], w_hh, rec, "float64", steps=gates)
        assert standin.calls == []  # planned, not run
        for t in (3, 2, 0):
            prepared(t)
            assert np.allclose(rec, gates[t][:, :6] @ w_hh, rtol=1e-12, atol=1e-12)
        prepared()  # its own a again
        assert np.allclose(rec, gates[0][:, :6] @ w_hh, rtol=1e-12, atol=1e-12)
        assert len(standin.calls) == 4
        assert len(set(standin.calls)) == 1  # the same call; the results show a moved
        with pytest.raises(ValueError, match="steps"):
            _blas.Prepared(gates[1][:, :6], w_hh, rec, "float64", steps=gates)
    finally:
        _blas.restore(previous)
