"""Tables as text: Markdown for the notebooks and reports, aligned plain text for the command line.

Every Markdown table is built here, so that a cell can never break its row: a `|` in cell text is escaped
(`\\|`, as GitHub-flavoured Markdown reads it, code spans included), and so are a backslash and a backtick
(which would open a code span), and a line break becomes a space. Each row then has exactly as many cells
as the header. A code cell whose text holds a backslash before a pipe is written as plain text: inside a
code span that backslash could not be shown.
"""

from __future__ import annotations

import re


def _cell(value, code: bool = False) -> str:
    text = " ".join(str(value).split("\n")).strip()
    if code and text and "\\|" not in text:  # a code span keeps * _ and backslashes literal
        text = text.replace("|", "\\|")
        if "`" not in text:
            return f"`{text}`"
        fence = "`" * (max(len(run) for run in re.findall("`+", text)) + 1)  # longer than any run inside
        return f"{fence} {text} {fence}"  # the spaces, which GFM strips, part a backtick from the fence
    return text.replace("\\", "\\\\").replace("|", "\\|").replace("`", "\\`")


def markdown(header: list, rows: list[list], code: tuple[int, ...] = (), plain: tuple = ("-", "?")) -> str:
    """A Markdown table; cells of the columns in `code` go in code spans (file names, settings), except the
    placeholders in `plain`."""
    lines = ["| " + " | ".join(_cell(h) for h in header) + " |", "|" + "---|" * len(header)]
    for row in rows:
        cells = [_cell(x, i in code and str(x).strip() not in plain) for i, x in enumerate(row)]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def text(header: list, rows: list[list]) -> str:
    """Columns aligned with spaces, a rule under the header."""
    rows = [[" ".join(str(x).split("\n")) for x in r] for r in [header, *rows]]
    widths = [max(len(x) for x in col) for col in zip(*rows)]
    fmt = lambda r: "  ".join(x.ljust(w) for x, w in zip(r, widths)).rstrip()  # noqa: E731
    return "\n".join([fmt(rows[0]), fmt(["-" * w for w in widths])] + [fmt(r) for r in rows[1:]])
