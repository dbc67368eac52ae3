"""Builds the optional native trace scanner (traceana/ingest/_scan.c); everything else is in pyproject.toml.

``optional=True``: without a C compiler the install still succeeds and ingest uses its pure-Python decoder.
"""

import zlib
from pathlib import Path

from setuptools import Extension, setup

# The source's CRC-32 is built into the module (_scan.SOURCE_CRC): traceana.ingest.reading refuses a scanner built
# from another _scan.c (an editable install not rebuilt after a pull) instead of failing inside it.
SOURCE = "traceana/ingest/_scan.c"
CRC = zlib.crc32((Path(__file__).parent / SOURCE).read_bytes())

setup(ext_modules=[Extension("traceana.ingest._scan", [SOURCE], optional=True,
                             define_macros=[("TRACEANA_SCAN_SOURCE_CRC", f"{CRC}u")])])
