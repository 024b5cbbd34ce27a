"""The compiled pickle scan, built where a C compiler is (the metadata is pyproject.toml's).

``optional=True``: where it cannot be compiled, setuptools warns and installs the package without it, and
``pickle_limits`` scans in Python.
"""

from setuptools import Extension, setup

setup(ext_modules=[Extension("optim_repair.formats._scan", ["optim_repair/formats/_scan.c"], optional=True)])
