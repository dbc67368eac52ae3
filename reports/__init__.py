"""HTML reports of analysed runs. Reads traceana's tables only; never parses a trace.

frames.py      analysis tables → the small frames the figures draw (polars, no plotting)
palette.py     the Okabe–Ito colours, one per attribution category and per run
figures.py     holoviews (bokeh backend) figures; imports holoviews, so only build.py imports it, lazily
html.py        page template, tables, number rounding and escaping: the only module writing markup
summary.py     run facts (run.json), what was inferred, headline numbers
validation.py  estimate vs measured from traceana.validation, guarded so that it never fails a report
sections.py    the report's sections in page order
build.py       build_report / write_report: one self-contained HTML file (bokeh JavaScript inline)
command.py     `traceana report`;  demo_command.py: `traceana demo`
"""
