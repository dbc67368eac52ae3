"""Read a report back like a machine would: its sections, tables, script tags and external references."""

from __future__ import annotations

import re
from html.parser import HTMLParser

NETWORK = re.compile(r"^\s*(https?:)?//", re.I)


class ReportParser(HTMLParser):
    def __init__(self) -> None:
        super().__init__(convert_charrefs=True)
        self.section_ids: list[str] = []
        self.tables: list[dict] = []  # {"section": id, "header": [...], "rows": [[...]]}
        self.network_refs: list[tuple[str, str, str]] = []  # (tag, attr, value)
        self.scripts: list[str] = []
        self.plot_divs = 0
        self._section = None
        self._table = None
        self._row = None
        self._cell = None
        self._in_script = False
        self._script = []

    def handle_starttag(self, tag, attrs):
        a = dict(attrs)
        for k, v in attrs:
            if k in ("src", "href", "action", "data", "poster") and v and NETWORK.match(v):
                self.network_refs.append((tag, k, v))
        if tag == "section":
            self._section = a.get("id")
            self.section_ids.append(self._section)
        elif tag == "table":
            self._table = {"section": self._section, "header": [], "rows": []}
        elif tag == "tr" and self._table is not None:
            self._row = []
        elif tag in ("td", "th") and self._row is not None:
            self._cell = []
        elif tag == "script":
            self._in_script, self._script = True, []
        elif tag == "div" and a.get("class") == "plot":
            self.plot_divs += 1

    def handle_endtag(self, tag):
        if tag in ("td", "th") and self._cell is not None:
            self._row.append("".join(self._cell).strip())
            self._cell = None
        elif tag == "tr" and self._row is not None:
            if not self._table["header"] and not self._table["rows"]:
                self._table["header"] = self._row
            else:
                self._table["rows"].append(self._row)
            self._row = None
        elif tag == "table" and self._table is not None:
            self.tables.append(self._table)
            self._table = None
        elif tag == "script":
            self._in_script = False
            self.scripts.append("".join(self._script))

    def handle_data(self, data):
        if self._cell is not None:
            self._cell.append(data)
        if self._in_script:
            self._script.append(data)


def parse(text: str) -> ReportParser:
    p = ReportParser()
    p.feed(text)
    p.close()
    return p


def table_in(parsed: ReportParser, section: str, first_header: str, *, index: int = 0) -> dict:
    tables = [t for t in parsed.tables if t["section"] == section and t["header"][:1] == [first_header]]
    assert len(tables) > index, f"no table #{index} starting with {first_header!r} in section {section!r}"
    return tables[index]


def table_with(parsed: ReportParser, section: str, header: str) -> dict:
    """The only table of ``section`` having a column headed ``header``."""
    tables = [t for t in parsed.tables if t["section"] == section and header in t["header"]]
    assert len(tables) == 1, f"{len(tables)} tables with column {header!r} in section {section!r}"
    return tables[0]
