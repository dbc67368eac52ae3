"""The commands traceana itself holds (analyze, merge, estimate, validate, whatif, watch: each a module with
``add_arguments`` and ``run``), the registry that names every command's module once (``registry``: collect and
attach live in collectors/, report and demo in reports/), the options two commands share (``options``) and what
they write (``export``: tables, the JSON summary, the merged Perfetto trace). The top of traceana's layers: it
imports any layer below, and only the command being run is imported."""
