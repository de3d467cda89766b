"""Every Markdown table is built by tables.markdown: whatever its cells hold (pipes, backslashes, line
breaks, backticks), each row has exactly the header's number of cells, and the text reads back."""

import re

from hypothesis import given, settings
from hypothesis import strategies as st

from cloudml_lib.base import tables
from cloudml_lib.data.flights import HEADER, format_table

cells = st.text(alphabet=st.sampled_from("ab |\\`*_\n-"), max_size=12)


def split_row(line: str) -> list[str]:
    """A GitHub-flavoured Markdown table row's cells, as GFM splits them: at each pipe that no backslash
    escapes (a backslash escapes the character after it), the outer pipes dropped, each cell trimmed."""
    assert line.startswith("|") and line.endswith("|"), line
    cells, cell, chars = [], "", iter(line[1:-1])
    for c in chars:
        if c == "\\":
            cell += c + next(chars, "")
        elif c == "|":
            cells, cell = [*cells, cell], ""
        else:
            cell += c
    return [c.strip() for c in [*cells, cell]]


def unescape(cell: str, code: bool) -> str:
    if code and cell.startswith("`"):
        fence = re.match("`+", cell).group()
        inner = cell[len(fence) : -len(fence)]
        return (inner[1:-1] if len(fence) > 1 else inner).replace("\\|", "|")
    return re.sub(r"\\(.)", r"\1", cell)


@settings(max_examples=200, derandomize=True, deadline=None)
@given(header=st.lists(cells, min_size=1, max_size=4), data=st.data())
def test_every_row_has_the_headers_cells_and_reads_back(header, data):
    rows = data.draw(st.lists(st.lists(cells, min_size=len(header), max_size=len(header)), max_size=3))
    code = tuple(i for i in range(len(header)) if data.draw(st.booleans()))
    lines = tables.markdown(header, rows, code=code).split("\n")
    assert len(lines) == len(rows) + 2 and lines[1] == "|" + "---|" * len(header)
    for line, row, coded in zip([lines[0], *lines[2:]], [header, *rows], [(), *[code] * len(rows)]):
        got = split_row(line)
        assert len(got) == len(header), (line, row)
        for i, (cell, value) in enumerate(zip(got, row)):
            expected = " ".join(value.split("\n")).strip()
            assert unescape(cell, i in coded and expected not in ("-", "?")) == expected, (line, row)


def test_the_flight_tables_header_with_pipes_is_one_table():
    """`|dt| median / p95` once broke the setup notebook's flight table into a paragraph of text."""
    lines = format_table([["x"] * len(HEADER)], markdown=True).split("\n")
    assert len(split_row(lines[0])) == len(HEADER) == len(split_row(lines[2]))
