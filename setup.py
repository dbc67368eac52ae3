"""Builds the optional native trace scanner (traceana/ingest/_scan.c); everything else is in pyproject.toml.

``optional=True``: without a C compiler the install still succeeds and ingest uses its pure-Python decoder.
"""

from setuptools import Extension, setup

setup(ext_modules=[Extension("traceana.ingest._scan", ["traceana/ingest/_scan.c"], optional=True)])
