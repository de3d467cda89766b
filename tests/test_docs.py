"""Documentation that cannot rot: every relative link in README.md, the other Markdown files at the top of
the repository and docs/ leads to a file of the checkout, and every anchor (`#section`, in the same file or
another) to a heading there, as GitHub renders it."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
PAGES = sorted([*REPO.glob("*.md"), *(REPO / "docs").rglob("*.md"), REPO / "benchmarks" / "RESULTS.md"])
LINK = re.compile(r"(?<!\!)\[[^\]]*\]\(([^)\s]+)\)|\!\[[^\]]*\]\(([^)\s]+)\)")
FENCE = re.compile(r"^(```|~~~).*?^\1", re.S | re.M)


def github_anchor(heading: str) -> str:
    """The anchor GitHub gives a heading: lower case, markup and punctuation but '-' and '_' dropped, each
    space a '-'."""
    text = re.sub(r"`([^`]*)`", r"\1", heading.strip())
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", text)
    return re.sub(r"[^\w\- ]", "", text.lower()).replace(" ", "-")


def anchors(page: Path) -> set[str]:
    """Each heading's anchor, numbered as GitHub numbers repeats (x, x-1, x-2)."""
    seen, out = {}, set()
    for line in FENCE.sub("", page.read_text()).splitlines():
        m = re.match(r"#{1,6}\s+(.*)", line)
        if m:
            a = github_anchor(m.group(1))
            out.add(a if a not in seen else f"{a}-{seen[a]}")
            seen[a] = seen.get(a, 0) + 1
    return out


def links(page: Path) -> list[str]:
    text = FENCE.sub("", page.read_text())
    text = re.sub(r"`[^`\n]*`", "", text)  # code spans are not links
    return [a or b for a, b in LINK.findall(text)]


def test_the_anchor_rule_is_githubs():
    assert github_anchor("What a run reports: test flights, validation data and their numbers") == (
        "what-a-run-reports-test-flights-validation-data-and-their-numbers"
    )
    assert (
        github_anchor("Cloud / no-cloud and prediction intervals")
        == "cloud--no-cloud-and-prediction-intervals"
    )
    assert github_anchor("Several GPUs (torchrun)") == "several-gpus-torchrun"
    assert github_anchor("The `train.deterministic` switch") == "the-traindeterministic-switch"


def broken_links(page: Path) -> list[str]:
    """Each relative link of `page` that leads to no file, or to no heading of a Markdown file."""
    broken = []
    for target in links(page):
        if re.match(r"[a-z][a-z0-9+.-]*:", target):  # https:, mailto:: not checked offline
            continue
        path, _, anchor = target.partition("#")
        where = (page.parent / path).resolve() if path else page
        if not where.exists():
            broken.append(f"{target}: no such file")
        elif anchor and where.suffix == ".md" and anchor not in anchors(where):
            broken.append(f"{target}: no heading with the anchor #{anchor} in {where.name}")
    return broken


def test_a_broken_link_or_anchor_is_found(tmp_path):
    (tmp_path / "other.md").write_text("# Other page\n\n## A `code` heading\n")
    page = tmp_path / "page.md"
    page.write_text(
        "# Page\n\n[fine](#page) [fine](other.md#a-code-heading) ![fine](other.md) [web](https://x.org/#y)\n"
        "[gone](missing.md) [no anchor](#nowhere) [no anchor there](other.md#other) `[code](not-a-link.md)`\n"
        "```\n[in a fence](fenced.md)\n```\n"
    )
    assert broken_links(page) == [
        "missing.md: no such file",
        "#nowhere: no heading with the anchor #nowhere in page.md",
        "other.md#other: no heading with the anchor #other in other.md",
    ]


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(REPO)))
def test_every_relative_link_and_anchor_leads_somewhere(page):
    broken = broken_links(page)
    assert not broken, f"{page.relative_to(REPO)}: " + "; ".join(broken)


COMMAND_LINE = re.compile(r"-m cloudml_lib((?:[ \t]+[^\s`#|&\\]+)*)")


def shown_commands() -> list[tuple[str, str, list[str]]]:
    """Each `python -m cloudml_lib ...` (or `torchrun ... -m cloudml_lib ...`) the pages show: (page, the
    command, the options it uses)."""
    out = []
    for page in PAGES:
        for m in COMMAND_LINE.finditer(page.read_text()):
            words = m.group(1).split()
            command = words[0].strip("([") if words and not words[0].startswith("-") else ""
            options = [
                re.sub(r"[=\]\)].*", "", w.lstrip("[(")) for w in words if w.lstrip("[(").startswith("--")
            ]
            out.append((page.relative_to(REPO).as_posix(), command, options))
    return out


def test_the_commands_shown_exist_with_the_options_shown():
    """What README and the docs show is what `--help` offers: every command, every option of it."""
    import argparse

    from cloudml_lib.commands.cli import build_parser

    parser = build_parser()
    (sub,) = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    shown, wrong = shown_commands(), []
    assert len(shown) > 30 and {c for _, c, _ in shown} >= {"train", "predict", "crossval", "sweep", "export"}
    for page, command, options in shown:
        if command in ("COMMAND", "...") or command.isupper():
            continue  # a placeholder
        if command and command not in sub.choices:
            wrong.append(f"{page}: no command {command!r}")
            continue
        known = (sub.choices[command] if command else parser)._option_string_actions
        wrong += [f"{page}: {command or 'cloudml_lib'} has no option {o}" for o in options if o not in known]
    assert not wrong, "\n".join(wrong)


def command_reference() -> str:
    """docs/reference/command-line.md's table of every command and option, drawn from the CLI's parser."""
    import argparse

    from cloudml_lib.commands.cli import build_parser

    parser = build_parser()
    (sub,) = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    helps = {c.dest: c.help for c in sub._choices_actions}
    parts = []
    for name, command in sub.choices.items():
        rows = ["| option | what it does |", "|---|---|"]
        for a in command._actions:
            if isinstance(a, argparse._HelpAction):
                continue
            shown = ", ".join(a.option_strings) or (a.metavar or a.dest.upper())
            if a.option_strings and a.nargs != 0:
                shown += f" {a.metavar or a.dest.upper()}"
            text = (a.help or "") % {**vars(a), "prog": command.prog} if "%(" in (a.help or "") else a.help
            shown, text = shown.replace("|", "\\|"), (text or "").replace("|", "\\|")  # a cell's own bars
            rows.append(f"| `{shown}` | {text} |")
        parts.append(f"### {name}\n\n{helps.get(name) or ''}\n\n" + "\n".join(rows))
    return "\n\n".join(parts)


def generated_block(page: str, maker, to_end: bool) -> None:
    """The block after `page`'s marker `<!-- generated: tests/test_docs.py maker() -->` (to the page's end, or
    to the next blank line) equals `maker()`, the code's own table."""
    mark = f"<!-- generated: tests/test_docs.py {maker.__name__}() -->\n"
    text = (REPO / page).read_text()
    assert mark in text, f"{page} lost its generated block's marker"
    shown = text.split(mark, 1)[1]
    shown = (shown if to_end else shown.split("\n\n", 1)[0]).strip()
    assert shown == maker(), f"{page} is stale: replace the block after its marker with {maker.__name__}()"


def test_the_command_reference_is_the_parsers():
    generated_block("docs/reference/command-line.md", command_reference, to_end=True)


def variables_table() -> str:
    """docs/reference/netcdf.md's table of the NetCDF variables, drawn from science/products.py's VARIABLES
    (a run of today: the model's cloud flag on data.cloud_flag base_in_range, 90% intervals)."""
    from cloudml_lib.science import products
    from cloudml_lib.science.flagging import Flagging

    overrides = products.flag_variables(Flagging(definition="base_in_range"))
    rows = [
        "| variable | type | units | what it holds | flag values | CSV column |",
        "|---|---|---|---|---|---|",
    ]
    for v in products.VARIABLES:
        a = overrides.get(v.name) or products.attributes(v, "90%")
        flags = ""
        if "flag_values" in a:
            flags = ", ".join(f"{int(k)} {m}" for k, m in zip(a["flag_values"], a["flag_meanings"].split()))
        cells = [
            f"`{v.name}`",
            v.dtype,
            a.get("units", ""),
            a.get("long_name", a.get("standard_name", "")),
            flags,
        ]
        cells.append(f"`{v.csv}`" if v.csv else "")
        rows.append("| " + " | ".join(str(c).replace("|", "\\|") for c in cells) + " |")
    return "\n".join(rows)


def test_the_netcdf_variables_table_is_the_products_table():
    generated_block("docs/reference/netcdf.md", variables_table, to_end=False)


def test_the_run_folder_page_names_every_file_a_run_writes():
    """Each name of base/layout.py's RunLayout (every file and folder a run writes) has its row."""
    from cloudml_lib.base.layout import RunLayout

    page = (REPO / "docs" / "reference" / "run-folder.md").read_text()
    names = {k: v for k, v in vars(RunLayout).items() if k.isupper() and isinstance(v, str)}
    assert len(names) > 10
    missing = {k: v for k, v in names.items() if f"| `{v}" not in page and f", `{v}" not in page}
    assert not missing, f"docs/reference/run-folder.md has no row for {missing}"


def test_the_run_states_page_says_each_state_in_the_codes_words():
    from cloudml_lib.core.run.status import RunState

    page = (REPO / "docs" / "reference" / "run-states.md").read_text()
    for kind in ("stopped", "running", "trained", "finished", "failed"):
        words = RunState(kind, "why").words
        assert f"`{words}`" in page, f"docs/reference/run-states.md lacks the state {words!r}"
