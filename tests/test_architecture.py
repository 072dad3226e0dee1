"""The layering of docs/architecture.md holds: `lint-imports` keeps the contracts in
pyproject.toml (imports only go down; the cpu and cuda backends are independent), and every
module of the package has its place in the layers."""

import os
import subprocess
import sys

import pytest

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    tomllib = pytest.importorskip("tomli")

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def contracts():
    with open(os.path.join(ROOT, "pyproject.toml"), "rb") as f:
        return tomllib.load(f)["tool"]["importlinter"]["contracts"]


def test_lint_imports_keeps_every_contract():
    pytest.importorskip("importlinter", reason="import-linter (the test extra) is not "
                                               "installed")
    # In a fresh interpreter started in the repository root, so that the numbaconv checked
    # is this checkout's, whatever is installed.
    proc = subprocess.run(
        [sys.executable, "-c", "import sys; from importlinter.cli import lint_imports; "
                               "sys.exit(lint_imports(config_filename='pyproject.toml', "
                               "no_cache=True, no_logo=True))"],
        cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert f"{len(contracts())} kept, 0 broken" in proc.stdout


def _modules(package: str) -> set:
    """The modules and subpackages directly in ``package`` (a dotted name)."""
    folder = os.path.join(ROOT, *package.split("."))
    modules = {f"{package}.{name[:-3]}" for name in os.listdir(folder)
               if name.endswith(".py") and name != "__init__.py"}
    return modules | {f"{package}.{name}" for name in os.listdir(folder)
                      if os.path.isfile(os.path.join(folder, name, "__init__.py"))}


@pytest.mark.parametrize("container", [None, "numbaconv.cpu"])
def test_every_module_has_a_layer(container):
    """The package's layers name every top-level module; the cpu backend's, every module in
    it."""
    [layers] = [c["layers"] for c in contracts()
                if c["type"] == "layers" and (c.get("containers") or [None])[0] == container]
    names = {name.strip() for layer in layers for name in layer.replace(":", "|").split("|")}
    placed = {f"{container}.{name}" for name in names} if container else names
    modules = _modules(container or "numbaconv")
    assert modules - placed == set(), "modules missing from the layers in pyproject.toml"
    assert placed - modules == set(), "layers naming modules that do not exist"
