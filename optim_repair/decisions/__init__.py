"""Pure decisions from an inventory: the optimizer registry, identification, diagnosis and the repair plan.

Nothing here reads or writes a file, or imports a format.
"""
