"""Tests of optim_repair.decisions: the registry, identification, diagnosis, the repair plan."""
