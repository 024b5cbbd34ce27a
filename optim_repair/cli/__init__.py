"""The ``optim-repair`` command line: a thin face over the library (``commands``) and its boundary (``boundary``)."""

from optim_repair.cli.commands import app, run

__all__ = ["app", "run"]
