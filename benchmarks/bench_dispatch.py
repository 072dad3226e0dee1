"""What validation and dispatch add to a call: a tiny problem, public call vs backend run.

The backend is whichever the dispatcher selects for the tiny problem (honouring
``NUMBACONV_BACKEND``), so the overhead measured is the one users pay. The target is under
20 microseconds per call.
"""

from numbaconv import bench
from numbaconv.problem import CONV_OPS


class DispatchOverhead:
    params = [list(CONV_OPS)]
    param_names = ["op"]

    def setup(self, op):
        self.public, self.direct, self.choice = bench.dispatch_callables(op)
        self.public()  # warm both up: compilation, the dispatcher's choice cache
        self.direct()

    def time_public_call(self, op):
        """The user's call: validation, normalisation, selection, the backend's run."""
        self.public()

    def time_backend_run(self, op):
        """The selected backend's run on pre-validated operands alone."""
        self.direct()

    def track_overhead_us(self, op):
        """Median public call minus median direct run, alternating samples (microseconds)."""
        return round(bench.dispatch_overhead([op], repeat=21)[0]["overhead_us"], 2)

    track_overhead_us.unit = "us"
