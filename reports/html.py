"""The report's HTML: page template, tables, number formatting and escaping. No plotting, no holoviews.

Every string that may come from a trace or a run directory (paths, event names, manifest fields, notes, warnings)
passes through ``esc`` before it reaches the page; only this module writes markup.
"""

from __future__ import annotations

import html
import math
from collections.abc import Iterable, Sequence

import polars as pl

from reports import palette


def esc(value: object) -> str:
    """HTML-escape anything (quotes included, so it is also safe inside attributes)."""
    return html.escape("" if value is None else str(value), quote=True)


def num(x: float | int | None, *, digits: int = 3) -> str:
    """A number rounded for people: about ``digits`` significant figures, thousands separated, never 1e-05."""
    if x is None or (isinstance(x, float) and (math.isnan(x) or math.isinf(x))):
        return "–"
    ax = abs(float(x))
    if ax == 0:
        return "0"
    if ax >= 10 ** (digits - 1):
        return f"{x:,.0f}"
    decimals = max(0, digits - 1 - math.floor(math.log10(ax)))
    return f"{x:,.{min(decimals, 4)}f}"


def signed(x: float | None, *, digits: int = 3) -> str:
    if x is None or (isinstance(x, float) and math.isnan(x)):
        return "–"
    return ("+" if x > 0 else "") + num(x, digits=digits)


def table(
    frame: pl.DataFrame,
    columns: Sequence[tuple[str, str]],
    *,
    formats: dict[str, str] | None = None,
    css_class: str = "num",
) -> str:
    """Render ``frame`` as an HTML table. ``columns``: (frame column, header with unit); every cell escaped.

    ``formats`` picks how a numeric column is shown: "num" (default for floats), "signed", "pct", "fraction" (0..1 shown as %), "signed_fraction", "int", "text".
    """
    formats = formats or {}
    head = "".join(f"<th>{esc(h)}</th>" for _, h in columns)
    body = []
    cols = {c: frame[c].to_list() for c, _ in columns}
    for i in range(frame.height):
        cells = []
        for c, _ in columns:
            v = cols[c][i]
            kind = formats.get(c) or ("num" if isinstance(v, float) else "text")
            if v is None:
                text = "–"
            elif kind == "num":
                text = num(v)
            elif kind == "signed":
                text = signed(v)
            elif kind == "pct":
                text = f"{num(v, digits=2)} %"
            elif kind == "signed_pct":
                text = f"{signed(v, digits=2)} %"
            elif kind == "fraction":  # a 0..1 fraction from traceana, shown as a percentage
                text = f"{num(100 * v, digits=2)} %"
            elif kind == "signed_fraction":
                text = f"{signed(100 * v, digits=2)} %"
            elif kind == "int":
                text = f"{int(v):,}"
            else:
                text = str(v)
            cells.append(f"<td>{esc(text)}</td>")
        body.append("<tr>" + "".join(cells) + "</tr>")
    return f'<table class="{esc(css_class)}"><thead><tr>{head}</tr></thead><tbody>{"".join(body)}</tbody></table>'


def facts(rows: Iterable[tuple[str, object]]) -> str:
    """A two-column key/value table (the run summary)."""
    body = "".join(f"<tr><th>{esc(k)}</th><td>{esc(v)}</td></tr>" for k, v in rows)
    return f'<table class="facts"><tbody>{body}</tbody></table>'


def bullet_list(items: Iterable[str], *, css_class: str = "notes") -> str:
    lis = "".join(f"<li>{esc(i)}</li>" for i in items)
    return f'<ul class="{esc(css_class)}">{lis}</ul>' if lis else ""


def para(text: str, *, css_class: str | None = None) -> str:
    cls = f' class="{esc(css_class)}"' if css_class else ""
    return f"<p{cls}>{esc(text)}</p>"


def key(colours: dict[str, str]) -> str:
    """A small HTML colour key (label → colour) above a figure: legends stay out of the plots' width."""
    items = "".join(
        f'<span class="swatch"><i style="background:{esc(c)}"></i>{esc(label)}</span>' for label, c in colours.items()
    )
    return f'<div class="key">{items}</div>'


def run_swatches(names: Sequence[str]) -> str:
    """The colour key of the runs in comparison figures."""
    return key({n: palette.run_colour(i) for i, n in enumerate(names)})


def legend_swatches(kinds: Iterable[str]) -> str:
    """The colour key of attribution categories, so the palette is explained once, above the figures."""
    return key({palette.CATEGORY_LABELS[k]: palette.CATEGORY_COLOURS[k] for k in kinds})


CSS = """
:root { --ink:#1d2330; --muted:#5b6475; --rule:#dfe3ea; --bg:#ffffff; --panel:#f6f7f9; }
* { box-sizing: border-box; }
body { margin:0; font:15px/1.5 system-ui,-apple-system,"Segoe UI",Roboto,"Helvetica Neue",Arial,sans-serif;
       color:var(--ink); background:var(--bg); }
header { padding:24px 40px 12px; border-bottom:1px solid var(--rule); }
header h1 { margin:0 0 4px; font-size:26px; }
header p { margin:0; color:var(--muted); }
nav { position:sticky; top:0; z-index:10; background:rgba(255,255,255,.95); border-bottom:1px solid var(--rule);
      padding:8px 40px; font-size:14px; }
nav a { margin-right:18px; color:#0072B2; text-decoration:none; }
main { padding:8px 40px 40px; max-width:1500px; }
section { margin:28px 0 8px; }
h2 { font-size:20px; margin:0 0 4px; border-bottom:2px solid var(--ink); padding-bottom:4px; }
h3 { font-size:16px; margin:18px 0 6px; }
p.lead { color:var(--muted); margin:4px 0 12px; max-width:1000px; }
p.warn { background:#fff4e0; border-left:4px solid #E69F00; padding:6px 10px; }
p.verdict { background:#e8f3fa; border-left:4px solid #0072B2; padding:8px 12px; max-width:1100px; }
p.error { background:#fdecea; border-left:4px solid #D55E00; padding:6px 10px; }
.cards { display:flex; flex-wrap:wrap; gap:18px; }
.card { background:var(--panel); border:1px solid var(--rule); border-radius:6px; padding:12px 16px; flex:1 1 420px; }
.card h3 { margin-top:0; }
.kpis { display:flex; flex-wrap:wrap; gap:12px; margin:8px 0 12px; }
.kpi { background:#fff; border:1px solid var(--rule); border-radius:6px; padding:6px 12px; min-width:120px; }
.kpi b { display:block; font-size:20px; }
.kpi span { color:var(--muted); font-size:12px; }
table { border-collapse:collapse; margin:6px 0 14px; font-size:13px; }
th, td { padding:4px 10px; border-bottom:1px solid var(--rule); text-align:left; vertical-align:top; }
table.num td { text-align:right; font-variant-numeric: tabular-nums; }
table.num td:first-child { text-align:left; }
thead th { background:var(--panel); }
table.facts th { color:var(--muted); font-weight:600; width:220px; }
table.facts td { word-break:break-all; }
ul.notes { margin:4px 0 12px; padding-left:20px; color:var(--muted); }
.key { display:flex; flex-wrap:wrap; gap:14px; font-size:13px; margin:6px 0 10px; }
.swatch i { display:inline-block; width:14px; height:14px; margin-right:5px; vertical-align:-2px;
            border:1px solid #999; }
.plot { margin:6px 0 18px; min-height:120px; }
.grid { display:grid; grid-template-columns:repeat(auto-fit, minmax(520px, 1fr)); gap:24px; }
.grid > div { min-width:0; }
footer { color:var(--muted); font-size:12px; padding:0 40px 30px; }
"""


def page(*, title: str, subtitle: str, nav: Sequence[tuple[str, str]], body: str, resources: str, script: str) -> str:
    """The whole document. ``body``, ``resources`` and ``script`` are markup this package made; the rest is escaped."""
    links = "".join(f'<a href="#{esc(anchor)}">{esc(text)}</a>' for anchor, text in nav)
    return (
        "<!DOCTYPE html>\n<html lang=\"en\">\n<head>\n<meta charset=\"utf-8\">\n"
        '<meta name="viewport" content="width=device-width, initial-scale=1">\n'
        f"<title>{esc(title)}</title>\n<style>{CSS}</style>\n{resources}\n</head>\n<body>\n"
        f"<header><h1>{esc(title)}</h1><p>{esc(subtitle)}</p></header>\n<nav>{links}</nav>\n"
        f"<main>\n{body}\n</main>\n"
        "<footer>Made by traceana from Kineto traces. Everything on this page is self-contained; it needs no "
        "network.</footer>\n"
        f"{script}\n</body>\n</html>\n"
    )
