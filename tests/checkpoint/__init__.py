"""Tests of optim_repair.checkpoint: discovery, reading, staging and writing of a checkpoint as a whole."""
