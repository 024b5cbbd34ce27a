"""Tests of optim_repair.formats.torchfile: torch files, zip and legacy."""
