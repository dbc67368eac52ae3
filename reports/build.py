"""Assemble one self-contained HTML report from one or more analysed runs.

    html_text = build_report([analysis_a, analysis_b], names=["baseline", "bpipe"])

Reads only ``traceana.measure.analysis.Analysis`` tables (and the run's manifest); calls ``traceana.validation`` when it
exists. The bokeh JavaScript and CSS are inlined, so the file opens with no network.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from pathlib import Path

from reports import html as H
from reports import sections
from reports.validation import Validated, default_cross_run, default_validation
from traceana.core.errors import AnalysisError, BadInputError
from traceana.measure.analysis import Analysis

Validation = Callable[[Analysis], Validated]


def check_analysable(a: Analysis) -> None:
    """A run with no steps, no schedule and no attribution cannot make a report worth reading: say so, clearly."""
    if a.steps.height == 0 and a.schedule.height == 0 and a.attribution.height == 0:
        raise AnalysisError(
            "no profiled training steps were found, so there is nothing to report",
            path=a.run.path,
            fix="profile at least one active step (ProfilerStep#N) with traceana collect or torch.profiler",
        )


def run_name(a: Analysis, taken: set[str]) -> str:
    name = a.run.path.name or str(a.run.path)
    base, k = name, 2
    while name in taken:
        name, k = f"{base} ({k})", k + 1
    taken.add(name)
    return name


class Page:
    """Collects HTML blocks and bokeh figures in order; the figures are embedded together at the end."""

    def __init__(self) -> None:
        self.parts: list[str | object] = []

    def add(self, markup: str) -> None:
        self.parts.append(markup)

    def figure(self, element) -> None:
        """A holoviews element, or the sentence a figure function returns when there is nothing to draw."""
        self.parts.append(H.para(element, css_class="warn") if isinstance(element, str) else element)

    def render(self) -> tuple[str, str]:
        from bokeh.embed import components

        from reports.figures import to_bokeh

        models = [to_bokeh(p) for p in self.parts if not isinstance(p, str)]
        script, divs = components(models) if models else ("", ())
        out, k = [], 0
        for p in self.parts:
            if isinstance(p, str):
                out.append(p)
            else:
                out.append(f'<div class="plot">{divs[k]}</div>')
                k += 1
        return "\n".join(out), script


def build_report(
    analyses: Sequence[Analysis],
    *,
    names: Sequence[str] | None = None,
    validation: Validation | None = default_validation,
    cross_run: Callable[..., dict | str] | None = default_cross_run,
    title: str | None = None,
    repeats: dict[str, Sequence[Analysis]] | None = None,
) -> str:
    """Return the report for ``analyses`` as one HTML string. Raises AnalysisError for a run with nothing to show.
    ``repeats``: more runs of a named run's configuration, whose spread the A/B comparison's noise includes."""
    if not analyses:
        raise BadInputError("no runs to report on", fix="pass one or more run directories")
    for a in analyses:
        check_analysable(a)
    from bokeh.resources import Resources

    from reports import figures as G  # holoviews: imported only now

    taken: set[str] = set()
    names = list(names) if names else [run_name(a, taken) for a in analyses]
    runs = list(zip(names, analyses, strict=True))
    page = Page()
    nav = [("summary", "Summary"), ("timeline", "Timeline"), ("attribution", "Attribution"),
           ("bubbles", "Bubbles"), ("memory", "Memory"), ("validation", "Estimate vs measured")]
    if len(runs) > 1:
        nav.append(("comparison", "A/B comparison"))

    sections.summary(page, runs, repeats=repeats)
    sections.timeline(page, runs, G)
    sections.attribution(page, runs, G)
    sections.bubbles(page, runs, G)
    sections.memory(page, runs, G)
    sections.validation(page, runs, G, validation)
    if len(runs) > 1:
        sections.comparison(page, runs, G, cross_run, repeats=repeats)

    body, script = page.render()
    # Only bokeh's own bundle, inline. Resources.render_js() would also add a <script src> that panel (imported by
    # holoviews) registers for its extensions: a relative path that does not exist beside the report, and that
    # plain holoviews plots do not need.
    resources = Resources(mode="inline", components=["bokeh"])
    inline_js = "".join(f"<script>\n{js}\n</script>\n" for js in resources.js_raw)
    subtitle = (f"{len(runs)} run{'s' if len(runs) > 1 else ''}: " + ", ".join(names)
                + f" · generated {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}")
    return H.page(
        title=title or "traceana report", subtitle=subtitle, nav=nav, body=body,
        resources=inline_js, script=script,
    )


def write_report(path: str | Path, analyses: Sequence[Analysis], **kwargs) -> Path:
    """Build the report and write it to ``path`` (parent folders created). Returns the path."""
    from traceana.core.files import write_text

    path = Path(path)
    text = build_report(analyses, **kwargs)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        write_text(path, text)  # a temporary renamed into place: a full disk keeps the older report, no partial one
    except OSError as e:
        raise BadInputError(f"cannot write the report ({e.strerror})", path=path,
                            fix="choose a writable path with -o") from None
    return path
