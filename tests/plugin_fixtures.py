"""Backends for dispatcher tests: wrappers of the reference with knobs."""

import time

from numbaconv.reference import ReferenceBackend


def failing_factory():
    raise RuntimeError("device initialisation failed")


def not_a_backend():
    return object()


class FakeBackend(ReferenceBackend):
    """The reference under another name, priority and device, declining on request."""

    def __init__(self, name, priority=50, device="cpu", decline=None, algorithms=("numpy",),
                 slow=(), unavailable=None):
        self.name = name
        self.priority = priority
        self.device = device
        self.decline = decline
        self._algorithms = tuple(algorithms)
        self.slow = set(slow)
        self._unavailable = unavailable
        self.runs = []

    def availability(self):
        return self._unavailable

    def supports(self, op, problem):
        if self.decline is not None and self.decline(op, problem):
            return f"{self.name} declines this one"
        return super().supports(op, problem)

    def algorithms(self, op, problem):
        return self._algorithms

    def choose(self, op, problem):
        return self._algorithms[-1], "test heuristic picks the last"

    def run(self, op, problem, operands, out, algorithm):
        self.runs.append((op, algorithm))
        if algorithm in self.slow:
            time.sleep(0.02)
        return super().run(op, problem, operands, out, "numpy")


class FailingBackend(FakeBackend):
    """Writes a first value into ``out`` (as a kernel part-way through would), then raises
    ``error`` from ``run``."""

    def __init__(self, name, error, priority=500):
        super().__init__(name, priority=priority)
        self.error = error

    def run(self, op, problem, operands, out, algorithm):
        self.runs.append((op, algorithm))
        if out is not None:
            out.reshape(-1)[0] = 123.0
        raise self.error
