"""GFLOP/s of numbaconv's own matrix product (``numbaconv.cpu._microkernel.gemm``, not yet
used by an algorithm) against NumPy's BLAS, both on one thread, on the products that bound
the GEMM-based convolutions: a square one, the 1x1 layers' skinny ones (ResNet's 64->256 at
56x56 and 1024->256 at 14x14, batch 8, in both orientations) and the 7x7 stem's weight
gradient (147 features x 64 outputs over 100,352 positions).
"""

import numpy as np
from threadpoolctl import threadpool_limits

#: (M, K, N) of ``(M, K) @ (K, N)``.
SHAPES = {
    "square_2048": (2048, 2048, 2048),
    "pointwise_64to256_dgrad": (25088, 256, 64),
    "pointwise_64to256_wgrad": (256, 25088, 64),
    "pointwise_1024to256_fwd": (1568, 1024, 256),
    "pointwise_1024to256_wgrad": (1024, 1568, 256),
    "stem_wgrad": (147, 100352, 64),
}


class Gemm:
    params = [list(SHAPES), ["numbaconv", "numpy"]]
    param_names = ["shape", "engine"]
    timeout = 300

    def setup(self, shape, engine):
        from numbaconv.cpu import _microkernel
        m, k, n = SHAPES[shape]
        rng = np.random.default_rng(0)
        self.a = rng.standard_normal((m, k)).astype(np.float32)
        self.b = rng.standard_normal((k, n)).astype(np.float32)
        self.out = np.empty((m, n), np.float32)
        self.flops = 2 * m * k * n
        self.limits = threadpool_limits(1)         # one BLAS thread, as our product has
        self.product = _microkernel.gemm if engine == "numbaconv" else \
            lambda a, b, out: np.matmul(a, b, out=out)
        self.product(self.a, self.b, self.out)     # compile outside the timing

    def teardown(self, shape, engine):
        self.limits.restore_original_limits()

    def time_gemm(self, shape, engine):
        self.product(self.a, self.b, self.out)

    def track_gflops(self, shape, engine):
        import time
        best = float("inf")
        for _ in range(3):
            start = time.perf_counter()
            self.product(self.a, self.b, self.out)
            best = min(best, time.perf_counter() - start)
        return round(self.flops / best / 1e9, 1)

    track_gflops.unit = "GFLOP/s"
