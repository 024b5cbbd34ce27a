"""Tests of the plain records: the key grammar."""
