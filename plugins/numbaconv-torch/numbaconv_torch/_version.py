"""The distribution's version, in one place (pyproject.toml reads it statically)."""

__version__ = "0.1.0"
