"""Plain data, no I/O and no decisions: the inventory, the repair plan, dtypes, and what a verification proved."""
