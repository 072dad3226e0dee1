"""The first call of each op and of a training step, in fresh processes: cold (an empty Numba
cache: compilation) and cached (the kernels loaded from Numba's disk cache).

Each measurement starts two new interpreters with a new, empty ``NUMBA_CACHE_DIR`` (see
:func:`numbaconv.bench.first_call_latency`), so asv's own process, which has compiled
kernels already, does not flatter the figures. The problem is
:data:`numbaconv.bench.FIRST_CALL_CASE`, float32, channels-first: what compiles is what a
ResNet 3x3 layer runs. Seconds, the first call as a user sees it (importing Numba included).
"""

from numbaconv import bench
from numbaconv.problem import CONV_OPS


class FirstCall:
    params = [list(CONV_OPS) + ["training_step"]]
    param_names = ["op"]
    # A cold training step compiles every kernel of the five ops: about a minute on 2 cores.
    timeout = 600
    # One measurement per benchmark, not asv's repeated samples: each costs two interpreters.
    number = 1
    repeat = 1

    def setup(self, op):
        ops = bench.TRAINING_STEP if op == "training_step" else op
        (self.result,) = bench.first_call_latency([ops])
        for kind in ("cold", "cached"):
            error = self.result[kind].get("error")
            if error:
                raise RuntimeError(f"{op}, {kind}: {error}")

    def track_cold_s(self, op):
        """First call with an empty cache: compiling the kernels it runs."""
        return round(self.result["cold"]["first_s"], 3)

    track_cold_s.unit = "s"

    def track_cached_s(self, op):
        """First call in a new process whose cache holds the kernels: loading them."""
        return round(self.result["cached"]["first_s"], 3)

    track_cached_s.unit = "s"
