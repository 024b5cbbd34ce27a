"""Tests of optim_repair.formats.dcp: DCP checkpoint directories."""
