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


def test_every_module_has_a_layer():
    (layers,) = [c["layers"] for c in contracts() if c["type"] == "layers"]
    placed = {name.strip() for layer in layers for name in layer.replace(":", "|").split("|")}
    package = os.path.join(ROOT, "numbaconv")
    modules = {f"numbaconv.{name[:-3]}" for name in os.listdir(package)
               if name.endswith(".py") and name != "__init__.py"}
    modules |= {f"numbaconv.{name}" for name in os.listdir(package)
                if os.path.isfile(os.path.join(package, name, "__init__.py"))}
    assert modules - placed == set(), "modules missing from the layers in pyproject.toml"
    assert placed - modules == set(), "layers naming modules that do not exist"
