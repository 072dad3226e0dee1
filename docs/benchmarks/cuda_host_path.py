"""numbaconv's own host time per call of the cuda backend's convolution ops, without a GPU.

A call's host time on a GPU is numbaconv's Python (validation, dispatch, the driver's
setup and arguments), Numba's and cuda.core's launch path, and the driver's. This times the
first part alone, on any machine: the public API on the GPU benchmark's layers
(numbaconv.bench_cuda.CASES, both layouts, every op, ``out=`` given, as the benchmark calls
them), with the GPU stood in by tests/gpu_standin.py (arrays that are an address, a shape
and strides; kernels that are a name and a key; launches recorded, not made). Numba's,
cuda.core's and the driver's parts are measured on a GPU (docs/benchmarks/gpu_host_time.py).

From the repository root::

    python docs/benchmarks/cuda_host_path.py [--reps 2000] [--case resnet] [--json FILE]

Prints microseconds per call: the best of 5 rounds of ``--reps`` calls each, after 10
warm-up calls (the first call of a problem validates it and works out its launch setup;
later ones reuse both).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "..", "tests"))


def _cpu() -> str:
    """The CPU's model name, with its family and model numbers (some machines name only
    the maker's line)."""
    fields = {}
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                name, _, value = line.partition(":")
                fields.setdefault(name.strip(), value.strip())
    except OSError:
        pass
    if "model name" not in fields:
        return platform.processor() or platform.machine()
    return (f"{fields['model name']} family {fields.get('cpu family', '?')} model "
            f"{fields.get('model', '?')}")


def measure(reps: int, patterns) -> list:
    """``[(case, layout, op, microseconds a call, launches a call)]``."""
    import gpu_standin

    import numbaconv
    from numbaconv import bench_cuda
    from numbaconv.cuda import CudaBackend

    rows = []
    with gpu_standin.setting() as patch, gpu_standin.standing_in(patch) as launches:
        patch(CudaBackend, "availability", lambda self: None)
        bench_cuda.ensure_cuda_backend()
        with numbaconv.use_backend("cuda"):
            for case in bench_cuda.select_cases(patterns=patterns):
                for layout in ("channels_first", "channels_last"):
                    operands = StandInOperands(case, layout)
                    for op in bench_cuda.ALL_OPS:
                        args, kwargs = operands.arguments(op)
                        call = getattr(numbaconv, op)
                        for _ in range(10):
                            call(*args, **kwargs)
                        del launches[:]
                        call(*args, **kwargs)
                        count = len(launches)
                        best = float("inf")
                        for _ in range(5):
                            start = time.perf_counter()
                            for _ in range(reps):
                                call(*args, **kwargs)
                            best = min(best, (time.perf_counter() - start) / reps)
                            del launches[:]
                        rows.append((case.name, layout, op, 1e6 * best, count))
    return rows


class StandInOperands:
    """numbaconv.bench_cuda.Operands' arrays as stand-ins (no PyTorch, no GPU)."""

    def __init__(self, case, layout):
        import gpu_standin
        self.case, self.layout = case, layout
        array = gpu_standin.DeviceArray
        self.arrays = dict(x=array(case.input_shape(layout), "float32"),
                           dy=array(case.output_shape(layout), "float32"),
                           w=array(case.weight_shape, "float32"))
        self.out = dict(conv=array(case.output_shape(layout), "float32"),
                        conv_backward_data=array(case.input_shape(layout), "float32"),
                        conv_backward_weight=array(case.weight_shape, "float32"),
                        conv_backward_bias=array((case.out_channels,), "float32"))

    def arguments(self, op):
        from numbaconv import bench_cuda
        return bench_cuda.Operands.arguments(self, op)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--reps", type=int, default=2000)
    parser.add_argument("--case", action="append", default=[],
                        help="only cases whose name contains this (repeatable)")
    parser.add_argument("--json", help="also write the rows here")
    args = parser.parse_args(argv)
    rows = measure(args.reps, args.case)
    header = (f"numbaconv host time a call, GPU stood in: {_cpu()}, Python "
              f"{platform.python_version()}, {time.strftime('%Y-%m-%d')}")
    print(header)
    print(f"{'case':24s} {'layout':15s} {'op':21s} {'us a call':>9s} {'launches':>8s}")
    for name, layout, op, us, count in rows:
        print(f"{name:24s} {layout:15s} {op:21s} {us:9.1f} {count:8d}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(header=header, rows=[dict(case=r[0], layout=r[1], op=r[2],
                                                     us=r[3], launches=r[4]) for r in rows]),
                      f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
