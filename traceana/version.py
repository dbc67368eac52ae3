"""traceana's version, on the ground floor: ingest keys its cache by it without importing the package above it."""

__version__ = "0.1.0"  # keep equal to pyproject.toml's
