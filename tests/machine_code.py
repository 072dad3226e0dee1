"""Reading CUDA machine code without a GPU: PTX from ``numba.cuda.compile_ptx``, a cubin and
its register report from the pip toolkit's ``ptxas -v``, SASS from ``nvdisasm``, and the
instruction mix of a kernel's main loop."""

from __future__ import annotations

import collections
import contextlib
import pathlib
import re
import subprocess
import types

#: Multiply-adds of the accumulators (HFMA2 is left out: ptxas also uses it to move constants).
FMA = ("FFMA", "DFMA")


#: The Numba code library of each kernel compiled so far in this process (see :func:`ptx`).
_LIBRARIES: dict = {}


def ptx(function, signature, cc, launch_bounds=None) -> str:
    """``numba.cuda.compile_ptx(function, signature, cc=cc, launch_bounds=...)[0]``, with
    Numba's part of the work (typing and lowering: most of a compile, NVVM the rest) done
    once per kernel in a process: its code library makes the PTX of each compute
    capability asked for (NVVM for each), the kernel known by its source (a template's
    expansion, or the function's code and closure). The lowered IR depends on the compute
    capability only below 7.5 (``tanh.approx`` under fastmath) and 6.0 (atomics), below
    every target here: tests/test_cuda_compile.py checks that the PTX is compile_ptx's."""
    key = (_identity(function), str(signature), launch_bounds)
    library = _LIBRARIES.get(key)
    if library is None:
        library = _LIBRARIES[key] = _library(function, signature, cc, launch_bounds)
    return library.get_asm_str(cc=cc)


def _identity(function):
    source = getattr(function, "__numbaconv_source__", None)
    if source is not None:
        return source
    cells = tuple(repr(cell.cell_contents) for cell in function.__closure__ or ())
    return function.__module__, function.__qualname__, function.__code__, cells


def _library(function, signature, cc, launch_bounds):
    """What ``compile_ptx`` compiles before it asks for PTX (numba-cuda 0.30's own helper),
    or, where a numba-cuda has no such helper, a stand-in that compiles anew each time."""
    from numba import cuda
    from numba.cuda import compiler
    compile_library = getattr(compiler, "_compile_pyfunc_with_fixup", None)
    if compile_library is None:
        return types.SimpleNamespace(get_asm_str=lambda cc: cuda.compile_ptx(
            function, signature, cc=cc, launch_bounds=launch_bounds)[0])
    return compile_library(function, signature, device=False, abi="numba", cc=cc,
                           launch_bounds=launch_bounds)[0]


def _tool(module: str, name: str):
    try:
        package = __import__(module, fromlist=["__path__"])
    except ImportError:
        return None
    for root in package.__path__:
        path = pathlib.Path(root) / "bin" / name
        if path.exists():
            return path
    return None


def ptxas():
    """The pip toolkit's ptxas (numba-cuda[cu12] brings it), or None."""
    return _tool("nvidia.cuda_nvcc", "ptxas")


def nvdisasm():
    """nvdisasm from the pip package nvidia-cuda-nvdisasm, or None."""
    return _tool("nvidia.cu13", "nvdisasm") or _tool("nvidia.cuda_nvdisasm", "nvdisasm")


def assemble(ptx: str, cc, folder: pathlib.Path, name: str, relocatable: bool = False) -> dict:
    """``ptxas -v`` on ``ptx``: registers, shared memory, spills, and the cubin's path.
    ``relocatable``: compile only (``-c``), leaving calls to functions defined elsewhere
    (a grid barrier's, in CUDA's device runtime) to the linker."""
    source = folder / f"{name}.ptx"
    cubin = folder / f"{name}.cubin"
    source.write_text(ptx)
    done = subprocess.run([str(ptxas()), "-v", f"-arch=sm_{cc[0]}{cc[1]}", str(source),
                           "-o", str(cubin)] + (["-c"] if relocatable else []),
                          capture_output=True, text=True, timeout=300)
    if done.returncode != 0:
        raise RuntimeError(done.stderr)

    def number(pattern):
        found = re.search(pattern, done.stderr)
        return int(found.group(1)) if found else 0
    return dict(registers=number(r"Used (\d+) registers"), smem=number(r"(\d+) bytes smem"),
                spill_stores=number(r"(\d+) bytes spill stores"),
                spill_loads=number(r"(\d+) bytes spill loads"),
                stack=number(r"(\d+) bytes stack frame"), cubin=cubin)


@contextlib.contextmanager
def device_query(cc):
    """numba-cuda's device query stood in by a device of compute capability ``cc`` while
    the block runs: it compiles the device functions a grid barrier calls (``cg.this_grid``)
    for the current device's, which needs a GPU otherwise."""
    from numba.cuda import dispatcher
    real = dispatcher.get_current_device
    dispatcher.get_current_device = lambda: types.SimpleNamespace(compute_capability=cc)
    try:
        yield
    finally:
        dispatcher.get_current_device = real


def disassemble(cubin: pathlib.Path) -> str:
    done = subprocess.run([str(nvdisasm()), "-c", "-gi", str(cubin)], capture_output=True,
                          text=True, timeout=300)
    if done.returncode != 0:
        raise RuntimeError(done.stderr)
    return done.stdout


def instructions(sass: str):
    """``[(opcode, text)]`` in address order, and ``{label: index}`` of the branch targets."""
    found, labels = [], {}
    for line in sass.splitlines():
        label = re.match(r"^\s*(\.L_x_\d+):", line)
        if label:
            labels[label.group(1)] = len(found)
            continue
        op = re.match(r"^\s+/\*[0-9a-f]{4,}\*/\s+(.*?);", line)
        if op:
            text = op.group(1).strip()
            found.append((re.sub(r"^@!?U?P\w+\s+", "", text).split()[0], text))
    return found, labels


def loops(sass: str):
    """The instructions and every loop as ``(first, last)`` indices (a backward branch)."""
    code, labels = instructions(sass)
    spans = []
    for i, (op, text) in enumerate(code):
        target = re.search(r"`\((\.L_x_\d+)\)", text)
        if op.startswith("BRA") and target and labels.get(target.group(1), i + 1) <= i:
            spans.append((labels[target.group(1)], i))
    return code, spans


def innermost(sass: str, opcode: str) -> list:
    """The ``[(opcode, text)]`` of the smallest loop holding an instruction whose opcode
    starts with ``opcode``."""
    code, spans = loops(sass)
    body = [code[a:b + 1] for a, b in spans]
    return min((loop for loop in body if any(op.startswith(opcode) for op, _ in loop)),
               key=len)


def main_loop(sass: str, trips: int, multiply: tuple = FMA) -> dict:
    """The reduction step of a tiled GEMM: the loop with the barrier around the
    multiply-add loop, which runs ``trips`` times a step. Counts are per step, as issued:
    the step loop's own instructions (all of them, conditional ones included) plus the
    multiply loop's times its trips. ``multiply``: the opcodes counted as ``fma`` (the
    tensor cores' ``HMMA``, say)."""
    code, spans = loops(sass)

    def fmas(span):
        return sum(1 for op, _ in code[span[0]:span[1] + 1]
                   if op.split(".")[0] in multiply)
    inner = max(spans, key=lambda s: (fmas(s), s[0] - s[1]))    # ties: the innermost

    def barrier(span):
        return any(op.startswith("BAR") for op, _ in code[span[0]:span[1] + 1])
    if barrier(inner):                  # the multiply loop was unrolled into the step
        outer, inner, trips = inner, None, 0
    else:
        outer = min((s for s in spans if s[0] <= inner[0] and s[1] >= inner[1]
                     and s != inner and barrier(s)), key=lambda s: s[1] - s[0])
    inner_count = inner[1] - inner[0] + 1 if inner else 0
    body = code[outer[0]:outer[1] + 1]
    total = len(body) - inner_count + trips * inner_count
    ops = collections.Counter(op.split(".")[0] for op, _ in body)
    fma_ops = sum(ops[name] for name in multiply)
    fma = fma_ops - (fmas(inner) if inner else 0) + trips * (fmas(inner) if inner else 0)
    return dict(instructions=total, fma=fma, fma_share=fma / total,
                calls=ops["CALL"], global_loads=ops["LDG"], shared_loads=ops["LDS"])
