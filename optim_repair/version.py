"""optim-repair's version, in the one place the package, its reports and pyproject.toml read it from."""

__version__ = "0.1.0"
