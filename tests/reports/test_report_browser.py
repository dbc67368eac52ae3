"""Open a report in headless Chromium from disk, with the network off: the plots render, nothing errors, nothing
injected runs. Skips when Chromium is absent (CI installs the Debian package `chromium`)."""

from __future__ import annotations

import dataclasses
import re
import shutil
import subprocess
from pathlib import Path

import pytest
from report_fixtures import make_analysis

from reports.build import write_report

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
pytestmark = pytest.mark.skipif(CHROMIUM is None, reason="headless Chromium is not installed")

INJECTED = "<script>document.title='pwned'</script>"


def chromium(page: Path, profile: Path, *extra: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [
            CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
            "--disable-background-networking", "--disable-component-update", "--disable-sync",
            f"--user-data-dir={profile}", "--enable-logging=stderr", "--v=0",
            # fake time so bokeh's deferred rendering finishes before the DOM is dumped, however slow the machine
            "--virtual-time-budget=15000",
            # any network access would fail: the report must not need it
            "--proxy-server=127.0.0.1:9", "--proxy-bypass-list=<-loopback>",
            *extra, page.as_uri(),
        ],
        capture_output=True, text=True, timeout=120,
    )


# Chromium's log does not say a console message's level, so everything the page logs is suspect except these:
# bokeh's own start-up chatter and Chromium's notice about software WebGL in a GPU-less headless run.
BENIGN = re.compile(r"\[bokeh [\d.]+\] (setting log level|document idle)|fallback to software WebGL")


def console_errors(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if ":CONSOLE" in line and not BENIGN.search(line)]


@pytest.fixture(scope="module")
def report(tmp_path_factory) -> Path:
    tmp = tmp_path_factory.mktemp("browser")
    evil = make_analysis(path=f"/runs/bpipe{INJECTED}", bpipe=True, notes=(f"inferred {INJECTED}",))
    evil = dataclasses.replace(evil, run=dataclasses.replace(evil.run, warnings=(INJECTED,)))
    return write_report(tmp / "report.html", [make_analysis(path="/runs/baseline"), evil], validation=None)


def test_plots_render_without_console_errors(report, tmp_path):
    done = chromium(report, tmp_path / "profile", "--dump-dom")
    dom = done.stdout
    assert "<title>traceana report</title>" in dom, "the injected script changed the title"
    roots = re.findall(r'data-root-id="[^"]+"[^>]*>\s*<div class="bk-Figure"', dom)
    plot_divs = report.read_text().count('<div class="plot">')
    assert plot_divs > 0 and len(roots) == plot_divs, "not every plot was rendered by bokeh"
    assert console_errors(done.stderr) == []


def test_screenshot(report, tmp_path):
    shot = tmp_path / "shot.png"
    done = chromium(report, tmp_path / "profile", f"--screenshot={shot}", "--window-size=1400,2400",
                    "--hide-scrollbars")
    assert shot.is_file() and shot.stat().st_size > 50_000, done.stderr[-2000:]
    assert console_errors(done.stderr) == []


# Appended to a copy of the report: once bokeh has built its documents, every plot title's text as the browser holds
# it (what the canvas draws), with < > & written as \u escapes so the dumped DOM's own escaping cannot blur them.
TITLE_PROBE = """<script>
(function poll() {
  var t = [];
  ((window.Bokeh && Bokeh.documents) || []).forEach(function (d) {
    d.all_models.forEach(function (m) { if (m.type === "Title" && m.text) t.push(String(m.text)); });
  });
  if (!t.length) { return setTimeout(poll, 100); }
  var p = document.createElement("pre"); p.id = "probe-titles";
  p.textContent = JSON.stringify(t).replace(/[<>&]/g, function (c) { return "\\\\u00" + c.charCodeAt(0).toString(16); });
  document.body.appendChild(p);
})();
</script>"""


def test_plot_titles_show_a_run_name_as_written(tmp_path):
    """Issue 29 said a --name such as ``<b>&`` showed as ``&lt;b&gt;&amp;`` in plot titles (escaped twice). The
    report file holds the title HTML-escaped inside bokeh's JSON, which BokehJS unescapes: in the browser each title
    is the run's name as written, plain text drawn on the canvas."""
    import json

    text = write_report(tmp_path / "r.html", [make_analysis(path="/runs/<b>&")], validation=None).read_text()
    probe = tmp_path / "probe.html"
    at = text.rindex("</body>")
    probe.write_text(text[:at] + TITLE_PROBE + text[at:])
    dom = chromium(probe, tmp_path / "profile", "--dump-dom").stdout
    found = re.search(r'<pre id="probe-titles">([^<]*)</pre>', dom)
    assert found, "bokeh built no plot titles"
    titles = json.loads(found.group(1))
    named = [t for t in titles if "b>" in t or "&" in t]  # (the memory titles name the run inside their text)
    assert sum(t.startswith("<b>&: ") for t in named) >= 3 and all("<b>&" in t for t in named), titles
    assert not any("&lt;" in t or "&amp;" in t for t in titles), titles
