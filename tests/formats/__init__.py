"""Tests of optim_repair.formats: one adapter per on-disk format."""
