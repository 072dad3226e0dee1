"""Every CUDA kernel compiles for real GPUs (no GPU needed): PTX for compute capabilities 8.0
and 9.0 (``numba.cuda.compile_ptx``'s, Numba's part of it done once for both:
``machine_code.ptx``), then the bundled ``ptxas -v``, whose registers, shared memory and
spills are recorded (``pytest -s`` prints them; docs/cuda.md quotes them). float32 and
float64 kernels must not spill. The register-tiled GEMMs, slower to compile, are read from
their machine code in tests/test_cuda_machine_code.py.
"""

import importlib.util
import os
import re
import sys

import pytest

if importlib.util.find_spec("numba_cuda") is None:
    pytest.skip("numba-cuda is not installed (the cuda extra)", allow_module_level=True)
if os.environ.get("NUMBA_ENABLE_CUDASIM", "0") not in ("", "0"):
    pytest.skip("compile_ptx is not available under the CUDA simulator",
                allow_module_level=True)

from numbaconv.config import CUDA_THREADS_PER_BLOCK, CUDA_TILE  # noqa: E402

sys.path.insert(0, os.path.dirname(__file__))
import machine_code  # noqa: E402

CCS = ((8, 0), (9, 0))


@pytest.mark.parametrize("layout", ["channels_first", "channels_last"])
@pytest.mark.parametrize("dtype", ["float16", "float32", "float64"])
def test_every_kernel_compiles(dtype, layout, tmp_path, record_property):
    from numbaconv.cuda import _bias, _depthwise
    cl = layout == "channels_last"
    kernels = [(f"dw_conv_{mode}_{layout}_{dtype}_{'s1' if s1 else 'strided'}"
                f"{'_grouped' if grouped else ''}",
                _depthwise.dw_conv_function(dtype, cl, mode, s1, False, mode == "forward",
                                            False, grouped),
                _depthwise._launch_types("dw_conv", (dtype,)))
               for mode in ("forward", "data") for s1 in (True, False)
               for grouped in (False, True)]
    kernels += [(f"bias_sums_{layout}_{dtype}_d{dims}_{'wide' if wide else '32'}",
                 _bias.bias_sums_function(dtype, cl, dims, wide, CUDA_THREADS_PER_BLOCK),
                 _bias.launch_types(dtype))
                for dims, wide in ((0, False), (1, False), (3, False), (3, True))]
    kernels = [(label, function, signature, CCS) for label, function, signature in kernels]
    if dtype == "float32":
        # The TF32 tensor-core GEMMs on the first architecture that has them (sm_90:
        # tests/test_cuda_machine_code.py), on a smaller tile than the machine-code test's.
        from numbaconv.cuda import _implicit_gemm
        kernels += [(label, function, signature, ((8, 0),))
                    for label, function, signature, _ in
                    _implicit_gemm.signatures(dtype, cl, tile=_implicit_gemm.TILES[3],
                                              tc=True)
                    if not (cl and label.startswith("weight_gemm"))]
        # and the 16-deep step of the largest tile
        kernels += [(label + "_deep", function, signature, ((8, 0),))
                    for label, function, signature, _ in
                    _implicit_gemm.signatures(dtype, cl, tc=True)
                    if label.startswith("conv_gemm_forward")]
    assert len(kernels) >= 4
    _compile_all(kernels, dtype, tmp_path, record_property)


def _compile_all(kernels, dtype, folder, record_property):
    """PTX of each ``(label, function, signature, compute capabilities)`` and, where the
    toolkit's ptxas is installed, its registers, shared memory and spills: none allowed
    but in float16 kernels."""
    ptxas = machine_code.ptxas()
    lines = []
    for label, function, signature, ccs in kernels:
        for cc in ccs:
            ptx = machine_code.ptx(function, signature, cc)
            assert ".entry" in ptx and f".target sm_{cc[0]}{cc[1]}" in ptx, (label, cc)
            if ptxas is None:
                continue
            report = machine_code.assemble(ptx, cc, folder, "kernel")
            record_property(f"{label}_sm{cc[0]}{cc[1]}", report)
            lines.append(f"sm_{cc[0]}{cc[1]} {label:36s} {report['registers']:4d} regs "
                         f"{report['smem']:6d} B smem  spills {report['spill_stores']}/"
                         f"{report['spill_loads']} B  stack {report['stack']} B")
            if dtype != "float16":
                assert report["spill_stores"] == report["spill_loads"] == 0, \
                    (label, cc, report)
    print("\n" + "\n".join(sorted(lines)))


@pytest.mark.parametrize("dtype", ["float16", "float32", "float64"])
def test_every_rnn_kernel_compiles(dtype, tmp_path, record_property):
    from numbaconv.cuda import _rnn_elementwise, _rnn_kernels
    kernels = _rnn_kernels.signatures(dtype, CUDA_TILE) + _rnn_elementwise.signatures(dtype)
    assert len(kernels) >= 25
    _compile_all([(label, function, signature, CCS) for label, function, signature in kernels],
                 dtype, tmp_path, record_property)


def _normalised(ptx: str) -> str:
    """PTX with the names a compile makes up (the kernel's mangled name, shared arrays')
    replaced: what two compiles of one kernel may differ in."""
    return re.sub(r"_cudapy_smem_\d+", "SMEM", re.sub(r"_ZN\w+", "NAME", ptx))


def test_one_front_end_gives_each_targets_ptx():
    """machine_code.ptx compiles a kernel's IR once and asks NVVM for each target: the PTX
    is compile_ptx's for that target (names aside), whichever target came first; a kernel
    with shared memory, with and without launch bounds, and a float16 one."""
    from numba import cuda

    from numbaconv.cuda import _bias, _rnn_elementwise
    bias = (_bias.bias_sums_function("float32", True, 3, False, CUDA_THREADS_PER_BLOCK),
            _bias.launch_types("float32"))
    half = _rnn_elementwise.signatures("float16")[0][1:]
    for (function, signature), bounds, order in ((bias, None, CCS), (half, None, CCS[::-1]),
                                                 (bias, (CUDA_THREADS_PER_BLOCK, 2), CCS)):
        shared = [machine_code.ptx(function, signature, cc, bounds) for cc in order]
        alone = [cuda.compile_ptx(function, signature, cc=cc, launch_bounds=bounds)[0]
                 for cc in order]
        assert _normalised(shared[0]) != _normalised(shared[1])
        for cc, a, b in zip(order, shared, alone):
            assert f".target sm_{cc[0]}{cc[1]}" in a
            assert _normalised(a) == _normalised(b)
        if bounds is not None:
            assert ".maxntid" in shared[0]
