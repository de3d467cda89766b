"""Which flights a run uses: listed in `data.flights`, or found in `data.dir` by their file names.

The users keep one folder per flight (`data/10Feb25/...`), with names such as
`GLOVE2025_IRAI_L1B_Rev-_20250210-003.h5` (IR, date YYYYMMDD, optional revision suffix),
`CPL_L2_V1-02_01kmLay_259015_10feb25.hdf5` (CPL layers, date ddmmmyy) and `CRS_20250210_nav.hdf`
(navigation, YYYYMMDD) or the public ICARTT nav `IMPACTS_MetNav_ER2_20250210_R0.ict` (preferred when
both are there: it has a time axis). Discovery scans `data.dir` recursively, groups the files by date, names
the flight after it (`10Feb25`), and picks the newest IR revision when there are several. A flight that
lacks a file is listed with what is missing, and skipped only with `data.skip_incomplete_flights`.
"""

from __future__ import annotations

import datetime as dt
import logging
import os
import re
from dataclasses import dataclass, field, replace
from pathlib import Path

from cloudml_lib.base import tables
from cloudml_lib.base.config import Config, DataConfig, FlightConfig, check_flight_names
from cloudml_lib.base.errors import ConfigError, DataError
from cloudml_lib.data import cpl, er2, times
from cloudml_lib.data.demo import demo_test_flights

log = logging.getLogger(__name__)

IR_NAME = re.compile(r"IRAI_L1B.*_(\d{8})(?:-(\d+))?\.h5$", re.IGNORECASE)
CPL_NAME = re.compile(r"^CPL_L2_.*Lay.*_\d{2}[a-z]{3}\d{2}\.hdf5?$", re.IGNORECASE)
NAV_NAME = re.compile(r"_(\d{8})_nav\.hdf5?$", re.IGNORECASE)
ICARTT_NAV_NAME = re.compile(r"MetNav_ER2_(\d{8})(?:_[A-Z0-9]+)*\.ict$", re.IGNORECASE)
ROLE_WORDS = {"ir": "IR", "cpl": "CPL", "nav": "nav"}
REMOVED_WORDS = {
    "bad_time": "bad time",
    "no_layer": "no layer",
    "multi_layer": "multi-layer",
    "out_of_range": "out of range",
    "over_land": "over land",
    "bad_surface": "surface",
    "unmatched": "no frame in time",
    "duplicate_frame": "same frame",
    "beyond_nav": "beyond nav",
    "edge_dropped": "at edges",
    "blank_frame": "blank frame",
}


@dataclass
class FoundFlight:
    """The files of one flight date found in data.dir (paths relative to it), and what is wrong."""

    name: str
    date: dt.date
    files: dict = field(default_factory=dict)  # role -> relative path
    problems: list = field(default_factory=list)

    def config(self) -> FlightConfig:
        return FlightConfig(
            name=self.name,
            ir_file=self.files.get("ir", ""),
            cpl_file=self.files.get("cpl", ""),
            nav_file=self.files.get("nav", ""),
            date=self.date.isoformat(),
        )


CAMPAIGN_PREFIX = re.compile(r"^([A-Za-z0-9][A-Za-z0-9_.-]*?)_IRAI_", re.IGNORECASE)


def campaign_of(ir_file: str) -> str | None:
    """The campaign an IR file's name gives (GLOVE2025 for GLOVE2025_IRAI_L1B_Rev-_20250210-003.h5), or None
    where the name has no such prefix."""
    found = CAMPAIGN_PREFIX.match(Path(ir_file).name)
    return found.group(1) if found else None


def campaign_groups(data: DataConfig) -> dict[str, list[str]]:
    """Each campaign with its flights, in the order of data.flights: data.campaigns where it is given (every
    flight in one), else from each IR file's name. A ConfigError names a flight without one."""
    names = [f.name for f in data.flights]
    if data.campaigns:
        of = {f: c["name"] for c in data.campaigns for f in c["flights"]}
        unknown = sorted(set(of) - set(names))
        missing = [n for n in names if n not in of]
        wrong = [f"{', '.join(unknown)} not among the flights ({', '.join(names)})"] if unknown else []
        wrong += [f"{', '.join(missing)} in no campaign"] if missing else []
        if wrong:
            raise ConfigError(f"data.campaigns: {'; '.join(wrong)}; each flight of data.flights is in one")
    else:
        of = {f.name: campaign_of(f.ir_file) for f in data.flights}
        missing = [n for n, c in of.items() if c is None]
        if missing:
            raise ConfigError(
                f"data.fold_by campaign: the IR file of {', '.join(missing)} names no campaign (expected a "
                "name such as GLOVE2025_IRAI_L1B_...h5); state the grouping in data.campaigns, e.g. "
                "[{name: GLOVE2025, flights: [10Feb25, 12Feb25]}, ...]"
            )
    groups: dict[str, list[str]] = {}
    for n in names:
        groups.setdefault(of[n], []).append(n)
    return groups


def flight_name(date: dt.date) -> str:
    return f"{date.day:02d}{date.strftime('%b')}{date.year % 100:02d}"


def _yyyymmdd(text: str) -> dt.date | None:
    try:
        return dt.datetime.strptime(text, "%Y%m%d").date()
    except ValueError:
        return None


def classify(name: str) -> tuple[str, dt.date, int] | None:
    """(role, date, IR revision or -1) of a file name, or None when it is not a flight file."""
    m = IR_NAME.search(name)
    if m and _yyyymmdd(m.group(1)):
        return "ir", _yyyymmdd(m.group(1)), int(m.group(2)) if m.group(2) else -1
    if CPL_NAME.search(name) and times.date_from_cpl_name(name):
        return "cpl", times.date_from_cpl_name(name), -1
    m = NAV_NAME.search(name) or ICARTT_NAV_NAME.search(name)
    if m and _yyyymmdd(m.group(1)):
        return "nav", _yyyymmdd(m.group(1)), -1
    return None


def _pick(role: str, candidates: list[tuple[int, str]], flight: str) -> tuple[str | None, str | None]:
    """One file among several of a role: the newest IR revision, the 1 km CPL layer product."""
    if role == "ir":
        best = max(r for r, _ in candidates)
        candidates = [c for c in candidates if c[0] == best]
    if role == "cpl" and len(candidates) > 1:
        candidates = [c for c in candidates if "01kmlay" in c[1].lower()] or candidates
    if role == "nav" and len(candidates) > 1:  # ICARTT text has a time axis (and a heading): matched by time
        candidates = [c for c in candidates if c[1].lower().endswith(".ict")] or candidates
    if len(candidates) == 1:
        return candidates[0][1], None
    names = ", ".join(p for _, p in candidates)
    return (
        None,
        f"several {ROLE_WORDS[role]} files ({names}); keep one, or list flight {flight} in data.flights",
    )


def _linked_folder(root: Path, path: Path) -> bool:
    """Whether `path` is a symbolic link to a folder, said once, never searched: one inside the data folder
    leads where the search goes anyway (its files would count twice); one outside it would read flights from
    elsewhere without a word."""
    if not path.is_symlink():
        return False
    target = Path(os.path.realpath(path))
    inside = target == Path(os.path.realpath(root)) or Path(os.path.realpath(root)) in target.parents
    if inside:
        log.info("%s is a link to %s, inside the data folder: searched there, not twice", path, target)
    else:
        log.warning(
            "%s is a link to %s, outside the data folder (data.dir %s): not searched. To use the flights "
            "there, copy them into the data folder, or set data.dir to a folder that holds them.",
            path,
            target,
            root,
        )
    return True


def find_flights(data: DataConfig, skip_dirs: tuple[Path, ...] = ()) -> list[FoundFlight]:
    """Every flight date with at least one file in data.dir (recursively), sorted by date."""
    root = Path(data.dir)
    skip = {p.resolve() for p in skip_dirs}
    by_date: dict[dt.date, dict[str, list[tuple[int, str]]]] = {}
    for folder, dirs, files in os.walk(root):
        dirs[:] = sorted(
            d
            for d in dirs
            if not d.startswith(".")
            and (Path(folder) / d).resolve() not in skip
            and not _linked_folder(root, Path(folder) / d)
        )
        for name in sorted(files):
            found = classify(name)
            if found:
                role, date, revision = found
                rel = (Path(folder) / name).relative_to(root).as_posix()
                by_date.setdefault(date, {}).setdefault(role, []).append((revision, rel))
    flights = []
    for date in sorted(by_date):
        f = FoundFlight(flight_name(date), date)
        for role in er2.required_roles(data):
            candidates = by_date[date].get(role)
            if not candidates:
                f.problems.append(f"no {ROLE_WORDS[role]} file")
                continue
            chosen, problem = _pick(role, candidates, f.name)
            if chosen:
                f.files[role] = chosen
                if role == "nav" and len(candidates) > 1:
                    log.info(
                        "flight %s: using the ICARTT nav %s (it has a time axis) rather than %s",
                        f.name,
                        chosen,
                        ", ".join(p for _, p in candidates if p != chosen),
                    )
                if role == "ir" and len(candidates) > 1:
                    log.info(
                        "flight %s: using %s, the newest of %d IR revisions", f.name, chosen, len(candidates)
                    )
            else:
                f.problems.append(problem)
        flights.append(f)
    return flights


def _found_from_config(data: DataConfig) -> list[FoundFlight]:
    out = []
    for flight in data.flights:
        f = FoundFlight(flight.name, dt.date.min)
        try:
            paths = er2.flight_paths(flight, data)
        except DataError as e:
            f.problems.append(str(e).split(": ", 1)[-1])
            paths = {}
        for role, path in paths.items():
            if path.is_file():
                f.files[role] = getattr(flight, f"{role}_file")
            else:
                f.problems.append(f"{ROLE_WORDS[role]} file not found: {path}")
        out.append(f)
    return out


def resolve_flights(
    data: DataConfig, skip_dirs: tuple[Path, ...] = (), check_names: bool = True
) -> tuple[DataConfig, list[FoundFlight]]:
    """(`data` with data.flights the complete flights, listed or found, and their names checked; the flights
    skipped as incomplete). `data` itself is not changed. Raises DataError naming every incomplete flight and
    what it lacks (unless data.skip_incomplete_flights), and ConfigError for names that do not exist.
    """
    explicit = bool(data.flights)
    if not Path(data.dir).is_dir():
        raise DataError(
            f"data.dir {data.dir} does not exist or is not a folder. Point data.dir (or --data-dir) "
            "at the folder holding your flights; in Colab, check that Google Drive is mounted."
        )
    found = _found_from_config(data) if explicit else find_flights(data, skip_dirs)
    if not found:
        raise DataError(
            f"no ER-2 flight files found in data.dir ({data.dir}) or its sub-folders; expected names "
            "like GLOVE2025_IRAI_L1B_Rev-_20250210-003.h5, CPL_L2_V1-02_01kmLay_259015_10feb25.hdf5 "
            "and CRS_20250210_nav.hdf. Check data.dir, or list the flights in data.flights."
        )
    incomplete = [f for f in found if f.problems]
    if incomplete and not data.skip_incomplete_flights:
        advice = (
            "Put each missing file in place, fix its name in data.flights, or remove the flight from "
            "data.flights"
            if explicit
            else f"Add each missing file to data.dir ({data.dir}; any sub-folder)"
        )
        raise DataError(
            f"{len(incomplete)} of {len(found)} flights lack files:\n"
            + format_table(found_rows(found), FOUND_HEADER)
            + f"\n{advice}; or set data.skip_incomplete_flights: true to train without those flights."
        )
    for f in incomplete:
        log.warning("flight %s skipped: %s (data.skip_incomplete_flights)", f.name, "; ".join(f.problems))
    complete = [f for f in found if not f.problems]
    owners: dict[Path, str] = {}
    for f in complete:
        for role, rel in f.files.items():
            path = (Path(data.dir) / rel).resolve()
            if path in owners:
                raise ConfigError(
                    f"data.flights: flights {owners[path]} and {f.name} use the same {ROLE_WORDS[role]} "
                    f"file {rel}; its samples would be trained twice. Give each flight its own files."
                )
            owners[path] = f.name
    if not explicit:
        data = replace(data, flights=[f.config() for f in complete])
        log.info("found %d flights in %s: %s", len(complete), data.dir, ", ".join(f.name for f in complete))
    else:
        data = replace(data, flights=[fl for fl in data.flights if fl.name in {f.name for f in complete}])
    where = "data.flights" if explicit else f"the flights found in {data.dir}"
    problems = check_flight_names(data, [f.name for f in data.flights], where) if check_names else []
    if problems:
        raise ConfigError("the flights do not fit the config:\n  - " + "\n  - ".join(problems))
    return data, incomplete


def prepare_flights(data: DataConfig, check_names: bool = True) -> tuple[DataConfig, list[FoundFlight]]:
    """What a run does first: resolve the flights (the cache folders are not searched); the demo flights are
    written before, where a command starts (data/synthetic.ensure_demo_flights). Returns (the data settings
    with the flights resolved, the flights skipped as incomplete). `check_names=False` (cross-validation,
    which sets the test flight of each fold) skips the checks of data.test_flights, data.validation and
    data.overweight_flight."""
    from cloudml_lib.data.cache import cache_folders, check_folder_settings

    check_folder_settings(data)
    if data.demo and not data.test_flights:
        data = replace(data, test_flights=demo_test_flights(data.demo, data.test_flights))
    return resolve_flights(data, cache_folders(data), check_names)


def resolve_config(cfg: Config, check_names: bool = True) -> tuple[Config, list[FoundFlight]]:
    """prepare_flights for a whole config: (a new Config with the flights resolved, the flights skipped)."""
    data, skipped = prepare_flights(cfg.data, check_names)
    return replace(cfg, data=data), skipped


# ------------------------------------------------------------------------------------ the table

FOUND_HEADER = ["flight", "IR file", "CPL file", "nav file", "status"]
HEADER = [
    "flight",
    "IR file",
    "CPL file",
    "nav file",
    "frames",
    "lidar profiles",
    "labels kept",
    "removed by filter",
    "matched in camera span",
    "|dt| median / p95",
    "flips",
]
NOTE_AFTER = 48  # a problem longer than this goes under the table as a numbered note


def found_rows(found: list[FoundFlight]) -> list[list[str]]:
    return [
        [
            f.name,
            f.files.get("ir", "-"),
            f.files.get("cpl", "-"),
            f.files.get("nav", "-"),
            "; ".join(f.problems) if f.problems else "complete",
        ]
        for f in found
    ]


def _removed(counts: dict, notes: Notes | None = None, flight: str = "") -> str:
    """What each filter removed (the profiles' total is a column of its own); with `notes`, a list longer
    than a cell should hold becomes its total and a numbered note (a row never grows many lines tall)."""
    text = ", ".join(f"{word} {counts[k]}" for k, word in REMOVED_WORDS.items() if counts.get(k)) or "none"
    if notes is None or len(text) <= NOTE_AFTER:
        return text
    notes.append(f"{flight}: labels removed by filter: {text}")
    return f"{sum(counts.get(k) or 0 for k in REMOVED_WORDS)}: see note {len(notes)}"


def _match_cells(match: dict | None) -> list[str]:
    """The match rate of the filtered profiles inside the camera's time span, and the time differences."""
    if not match or match.get("match_rate") is None:
        return ["-", "-"]
    dt = "-" if match["dt_median_s"] is None else f"{match['dt_median_s']:.2f} / {match['dt_p95_s']:.2f} s"
    return [f"{match['matched']} of {match['inside_camera']} ({100 * match['match_rate']:.0f}%)", dt]


def flip_cell(no_heading: int | None, labels: int, note: str = "") -> str:
    """Whether the flip augmentation can run on a flight: it needs the aircraft heading."""
    if no_heading is None:
        return "-"
    if no_heading == 0:
        return "on"
    why = "no heading" if not note.startswith("no heading") else note.split(" (")[0]
    return f"off: {why}" if no_heading >= labels else f"off for {no_heading} of {labels}: {why}"


def _file_cells(files: dict) -> list[str]:
    return [Path(files[r]).name if files.get(r) else "-" for r in ("ir", "cpl", "nav")]


class Notes(list):
    """Problems too long for a table cell, numbered in the order they are met."""

    def cell(self, prefix: str, text: str) -> str:
        if len(text) <= NOTE_AFTER:
            return f"{prefix}: {text}"
        self.append(text)
        return f"{prefix}: see note {len(self)}"

    def text(self, markdown: bool = False) -> str:
        return "\n".join(f"{i}. {t}" if markdown else f"  ({i}) {t}" for i, t in enumerate(self, 1))


def summary_rows(
    data: DataConfig, caches: list, skipped: list[FoundFlight], notes: Notes | None = None
) -> list[list[str]]:
    """One row per flight: its files, frames, lidar profiles, labels kept and labels removed by each
    filter."""
    notes = Notes() if notes is None else notes
    files = {f.name: {"ir": f.ir_file, "cpl": f.cpl_file, "nav": f.nav_file} for f in data.flights}
    rows = [
        [c.name]
        + _file_cells(files.get(c.name, {}))
        + [
            str(c.meta["n_frames"]),
            str(c.meta["counts"]["profiles"]),
            str(c.meta["counts"]["samples"]),
            _removed(c.meta["counts"], notes, c.name),
        ]
        + _match_cells(c.meta.get("match"))
        + [
            flip_cell(
                c.meta["counts"].get("no_heading"), c.meta["counts"]["samples"], c.meta.get("heading", "")
            )
        ]
        for c in caches
    ]
    return rows + [
        [f.name]
        + _file_cells(f.files)
        + ["-", "-", "-", notes.cell("skipped", "; ".join(f.problems)), "-", "-", "-"]
        for f in skipped
    ]


ROLES_CELLS = 4  # a row: name, the three files' cells; then frames (a number, or "-" for a flight not usable)


def usable_in(rows: list[list[str]]) -> list[str]:
    """The flights that check_rows found usable: those whose frames cell holds a count."""
    return [r[0] for r in rows if len(r) > ROLES_CELLS and r[ROLES_CELLS] != "-"]


def check_rows(data: DataConfig, notes: Notes | None = None) -> tuple[list[list[str]], bool]:
    """The same table before any cache exists, reading each flight's labels (not its frames).
    Returns (rows, whether every flight is usable); long problems go to `notes`."""
    notes = Notes() if notes is None else notes
    found = _found_from_config(data) if data.flights else find_flights(data)
    rows, ok = [], bool(found)
    for f in found:
        if f.problems:
            rows.append(
                [f.name]
                + _file_cells(f.files)
                + ["-", "-", "-", notes.cell("missing", "; ".join(f.problems)), "-", "-", "-"]
            )
            ok = False
            continue
        try:
            labels = cpl.read_flight_labels(
                f.config() if not data.flights else next(x for x in data.flights if x.name == f.name), data
            )
            rows.append(
                [f.name]
                + _file_cells(f.files)
                + [
                    str(labels.n_frames),
                    str(labels.counts["profiles"]),
                    str(labels.heights),
                    _removed(labels.counts, notes, f.name),
                ]
                + _match_cells(labels.match)
                + [flip_cell(labels.counts["no_heading"], labels.heights, labels.heading_note)]
            )
        except DataError as e:
            rows.append(
                [f.name]
                + _file_cells(f.files)
                + ["-", "-", "-", notes.cell("not usable", str(e).split(": ", 1)[-1]), "-", "-", "-"]
            )
            ok = False
    return rows, ok


def format_table(rows: list[list[str]], header: list[str] = HEADER, markdown: bool = False) -> str:
    if markdown:  # file names (and glob patterns) in code spans: * and _ stay literal
        return tables.markdown(header, rows, code=(1, 2, 3))
    return tables.text(header, rows)
