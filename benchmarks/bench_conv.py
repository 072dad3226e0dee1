"""Time and peak memory of each convolution op through the public API, per standard shape
and CPU backend.

One class per op, each with ``time_<op>`` and ``peakmem_<op>`` methods, parametrised over
the shapes of :mod:`numbaconv.bench` (the small ``QUICK_SHAPES`` and the realistic
``SHAPES``: ResNet 3x3, pointwise 1x1, depthwise 3x3, the 7x7 stem, 1D and 3D layers) and
over the CPU backends available where the suite runs, discovered at import, never named
here. The same tables feed ``numbaconv bench`` and the tests (``tests/test_bench.py``
checks every backend against the reference on ``QUICK_SHAPES``). ``setup`` raises
``NotImplementedError`` (asv: skip) where a backend declines a problem and for the
plain-NumPy reference on the big shapes, which would take minutes. Shapes run
channels-first here; ``numbaconv bench`` times both layouts and summarises per group.
``peakmem_*`` is the process's peak resident memory after one call (asv's definition), so
it includes what the backend imported, and its workspaces.

``GemmPeak`` tracks the machine's matrix-product GFLOP/s (NumPy's BLAS, as
``numbaconv bench`` measures it), to set the convolution times against.
"""

from numbaconv import bench, use_backend

SHAPES = {case.name: case for case in bench.QUICK_SHAPES + bench.SHAPES}
BACKENDS = bench.cpu_backends() or ["reference"]


class _ConvOp:
    """Shared setup; subclasses set ``op`` and name their timing method after it."""

    op = None
    params = [list(SHAPES), BACKENDS]
    param_names = ["shape", "backend"]

    def setup(self, shape, backend):
        if backend == "reference" and shape in bench.BIG_SHAPE_NAMES:
            raise NotImplementedError("the reference backend is too slow on big shapes")
        self.call = bench.make_call(self.op, SHAPES[shape])
        why = bench.supports(backend, self.call)
        if why is not None:
            raise NotImplementedError(why)
        self.backend = backend
        self.run()  # compile and warm up outside the timing

    def run(self):
        with use_backend(self.backend):
            self.call()


class Conv(_ConvOp):
    op = "conv"

    def time_conv(self, shape, backend):
        self.run()

    def peakmem_conv(self, shape, backend):
        self.run()


class ConvBackwardData(_ConvOp):
    op = "conv_backward_data"

    def time_conv_backward_data(self, shape, backend):
        self.run()

    def peakmem_conv_backward_data(self, shape, backend):
        self.run()


class ConvBackwardWeight(_ConvOp):
    op = "conv_backward_weight"

    def time_conv_backward_weight(self, shape, backend):
        self.run()

    def peakmem_conv_backward_weight(self, shape, backend):
        self.run()


class ConvBackwardBias(_ConvOp):
    op = "conv_backward_bias"

    def time_conv_backward_bias(self, shape, backend):
        self.run()

    def peakmem_conv_backward_bias(self, shape, backend):
        self.run()


class ConvTranspose(_ConvOp):
    op = "conv_transpose"

    def time_conv_transpose(self, shape, backend):
        self.run()

    def peakmem_conv_transpose(self, shape, backend):
        self.run()


class GemmPeak:
    """GFLOP/s of ``np.matmul`` on 2048 x 2048 matrices: the machine's practical peak."""

    params = [["float32", "float64"]]
    param_names = ["dtype"]
    timeout = 120

    def track_gflops(self, dtype):
        return round(bench.gemm_peak(2048, dtype, repeat=3)["gflops"], 1)

    track_gflops.unit = "GFLOP/s"
