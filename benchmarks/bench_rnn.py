"""Recurrent networks: the training step of RNN/LSTM/GRU networks and its three ops, through
the public API, per shape of :mod:`numbaconv.bench_rnn` and CPU backend.

``TrainingStep`` times what a training loop runs per batch: ``rnn_forward(training=True)``
into a preallocated reserve, ``rnn_backward_data``, then ``rnn_backward_weights(out=)``; its
``peakmem_*`` is the process's peak resident memory (asv's definition) and its ``track_*``
the bytes one steady step allocates (tracemalloc; NumPy reports its buffers), which stays at
the size of y and dx: the reserve is reused. ``Ops`` times the three ops separately.
``numbaconv bench --suite rnn`` runs the same shapes against PyTorch.
"""

from numbaconv import bench, bench_rnn, rnn_backward_data, rnn_backward_weights, rnn_forward
from numbaconv import use_backend

CASES = {case.name: case for case in bench_rnn.QUICK_RNN_SHAPES + bench_rnn.RNN_SHAPES}
BIG = frozenset(case.name for case in bench_rnn.RNN_SHAPES)
BACKENDS = [b for b in bench.cpu_backends() if b in ("cpu", "reference")] or ["reference"]

class _RNN:
    params = [list(CASES), BACKENDS]
    param_names = ["case", "backend"]

    def setup(self, case, backend):
        if backend == "reference" and case in BIG:
            raise NotImplementedError("the reference backend is too slow on big shapes")
        self.step = bench_rnn.TrainingStep(CASES[case], backend)
        self.step()  # compile and warm up outside the timing

class TrainingStep(_RNN):
    def time_training_step(self, case, backend):
        self.step()

    def peakmem_training_step(self, case, backend):
        self.step()

    def track_allocated_bytes_per_step(self, case, backend):
        return bench_rnn.per_step_allocations(self.step, steps=1)

    track_allocated_bytes_per_step.unit = "bytes"

    def track_reserve_bytes(self, case, backend):
        return self.step.reserve.nbytes

    track_reserve_bytes.unit = "bytes"

class Ops(_RNN):
    def setup(self, case, backend):
        super().setup(case, backend)
        s = self.step
        with use_backend(backend):
            self.y = rnn_forward(s.cfg, s.x, s.params, training=True, reserve=s.reserve)[0]

    def _forward(self):
        s = self.step
        return rnn_forward(s.cfg, s.x, s.params, training=True, reserve=s.reserve)[0]

    def time_forward(self, case, backend):
        with use_backend(self.step.backend):
            self._forward()

    def time_forward_and_backward_data(self, case, backend):
        s = self.step
        with use_backend(s.backend):
            rnn_backward_data(s.cfg, self._forward(), s.dy, s.params, s.reserve)

    def time_backward_weights(self, case, backend):
        s = self.step
        with use_backend(s.backend):
            rnn_backward_weights(s.cfg, s.x, s.params, s.reserve, out=s.dparams)

    def time_inference_forward(self, case, backend):
        s = self.step
        with use_backend(s.backend):
            rnn_forward(s.cfg, s.x, s.params)

