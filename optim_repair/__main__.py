"""``python -m optim_repair``: the same command as ``optim-repair``."""

from optim_repair.console import main

main()
