"""Tests for optim-repair."""
