"""The package's version, read by the package root, the plan cache and `pyproject.toml`."""

__version__ = "0.1.0"
