"""Kernel templates for the cuda backend's generated kernels, expanded to plain Python and
compiled by ``cuda.jit``.

Numba does not unroll loops on request and NVVM leaves the register tile in local memory
unless every loop over it is unrolled, so the kernels are written as templates whose
``#unroll VAR COUNT ... #end`` blocks are repeated with ``{expression}`` filled in, and
whose ``#if EXPR ... #else ... #end`` blocks are kept or dropped by the constants (tile,
layout, dimensions) that key each kernel. The result is plain Python, compiled by cuda.jit.

The expanded source is written to a file named by its hash under the cache folder and imported
from there (:func:`compile_source`), so that Numba's disk cache keeps the compiled kernels.
"""

from __future__ import annotations

import hashlib
import importlib.util
import os
import re

from ..config import jit_cache, user_cache_dir
from ._layout import simulated

_DIRECTIVE = re.compile(r"^\s*#(unroll|if|elif|else|end)\b\s*(.*)$")


_FIELD = re.compile(r"\{([^{}]+)\}")


def _fill(line: str, names: dict) -> str:
    def value(match):
        try:
            return str(eval(match.group(1), {}, names))   # noqa: S307 - our own templates
        except NameError:
            return match.group(0)
    return _FIELD.sub(value, line)


def _expand(lines: list, names: dict) -> list:
    out = []
    i = 0
    while i < len(lines):
        found = _DIRECTIVE.match(lines[i])
        if not found:
            out.append(_fill(lines[i], names))
            i += 1
            continue
        kind, arg = found.groups()
        if kind not in ("unroll", "if"):
            raise ValueError(f"template: unmatched #{kind} at line {i}")
        branches, i = _block(lines, i + 1, arg)
        if kind == "unroll":
            var, count = arg.split(None, 1)
            for v in range(eval(count, {}, names)):          # noqa: S307
                out.extend(_expand(branches[0][1], dict(names, **{var: v})))
            continue
        for condition, body in branches:
            if condition is None or eval(condition, {}, names):   # noqa: S307
                out.extend(_expand(body, names))
                break
    return out


def _block(lines: list, i: int, condition: str):
    """The branches ``[(condition, lines)]`` of a block up to its #end (an #else branch has
    the condition None), and the index after the #end."""
    branches = [(condition, [])]
    depth = 0
    while i < len(lines):
        found = _DIRECTIVE.match(lines[i])
        kind = found.group(1) if found else None
        if kind in ("unroll", "if"):
            depth += 1
        elif kind == "end":
            if depth == 0:
                return branches, i + 1
            depth -= 1
        elif kind in ("elif", "else") and depth == 0:
            branches.append((found.group(2) if kind == "elif" else None, []))
            i += 1
            continue
        branches[-1][1].append(lines[i])
        i += 1
    raise ValueError("template: #unroll or #if without #end")


def compile_source(name: str, template: str, names: dict, types_: dict):
    """The function ``name`` defined by ``template`` expanded with ``names``.

    The source is written to a file named by its hash under the cache folder and imported
    from there, so that Numba's disk cache keeps the compiled kernel for later processes
    (these kernels are slow to compile: docs/cuda.md); with the cache off, or where the
    folder cannot be written, under the simulator too, it is executed in memory."""
    body = "\n".join(_expand(template.strip("\n").splitlines(), names)) + "\n"
    header = ["import numba", "from numba import cuda", ""]
    header += [f"{key} = numba.{value}" for key, value in sorted(types_.items())]
    header += [f"{key} = {value!r}" for key, value in sorted(names.items())
               if isinstance(value, (bool, int))]
    source = "\n".join(header) + "\n\n\n" + body
    function = None
    if jit_cache() and not simulated():
        function = _import_source(name, source)
    if function is None:
        namespace = {}
        exec(compile(source, f"<numbaconv.cuda {name} {names.get('KEY', '')}>", "exec"),
             namespace)                                           # noqa: S102
        function = namespace[name]
    function.__numbaconv_source__ = source
    function.__numbaconv_unroll__ = names.get("KU", 1)
    return function


def _import_source(name: str, source: str):
    """``name`` from ``source`` written once to the cache folder and imported, or None."""
    digest = hashlib.sha256(source.encode()).hexdigest()[:20]
    folder = os.path.join(user_cache_dir(), "cuda")
    path = os.path.join(folder, f"{name}_{digest}.py")
    try:
        if not os.path.exists(path):
            os.makedirs(folder, exist_ok=True)
            partial = f"{path}.{os.getpid()}.tmp"
            with open(partial, "w") as handle:
                handle.write(source)
            os.replace(partial, path)
        spec = importlib.util.spec_from_file_location(f"numbaconv_cuda_{name}_{digest}", path)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
    except OSError:
        return None
    return getattr(module, name)


def indent(text: str, spaces: int) -> str:
    pad = " " * spaces
    return "\n".join(pad + line[4:] if line.strip() and not _DIRECTIVE.match(line)
                     else line for line in text.strip("\n").splitlines())


def scalar_types(dtype: str, wide: bool):
    import numba
    acc = numba.float64 if dtype == "float64" else numba.float32
    index = numba.int64 if wide else numba.int32
    unsigned = numba.uint64 if wide else numba.uint32
    return acc, index, unsigned
