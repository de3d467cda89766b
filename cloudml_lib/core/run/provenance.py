"""What a result was made from, so that two results can be told apart: the label definition (layer, time
column, rounding, offset, filters), each flight's counts (profiles, removed by each filter, matched, kept)
and each input file's SHA-256.

A file's SHA-256 is computed once, when its flight's cache is built (data/hashing.py), and kept in the
cache's meta.json. Every checkpoint, `provenance.json` and `report.md` in the run directory, and the NetCDF
files of `predict` carry the record.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

from cloudml_lib.base.layout import RunLayout
from cloudml_lib.base.outputs import write_text

log = logging.getLogger(__name__)


def run_provenance(caches: list, data) -> dict:
    """The record of a run's data, from its flight caches (their meta.json holds counts, match and files)."""
    from cloudml_lib.data.cpl import label_definition

    return {
        "label_definition": label_definition(data),
        "inputs": {
            "sun_azimuth": data.sun_azimuth,
            "along_track_axis": data.along_track_axis,
            "angles_source": data.angles_source,
            "preprocess_backend": caches[0].backend if caches else "skimage",
        },
        "flights": {
            c.name: {
                "samples": len(c),
                "counts": c.meta.get("counts", {}),
                "match": c.meta.get("match", {}),
                "heading": c.meta.get("heading", ""),
                "files": c.meta.get("files", {}),
            }
            for c in caches
        },
    }


def trained_backend(record: dict | None) -> str | None:
    """The CLAHE backend a run's frames were made with (None: no record); records before the choice:
    skimage."""
    if not record:
        return None
    return record.get("inputs", {}).get("preprocess_backend", "skimage")


def read_run_provenance(run: RunLayout) -> dict | None:
    from cloudml_lib.base.runfiles import RunFiles

    files = RunFiles(run.path)
    record = files.provenance()
    for d in files.damaged:
        log.warning("%s: it is written again", d)
    return record or None


def write_run_provenance(run: RunLayout, record: dict) -> Path:
    return write_text(run.provenance, json.dumps(record, indent=1))


def markdown(record: dict) -> list[str]:
    """report.md's section: the label definition in one line, then one row per flight and file."""
    if not record:
        return []
    label = ", ".join(f"{k} {v}" for k, v in record.get("label_definition", {}).items())
    inputs = ", ".join(f"{k} {v}" for k, v in record.get("inputs", {}).items())
    out = [
        "## Data provenance",
        "",
        f"Labels: {label}.",
        "",
        f"Inputs: {inputs}.",
        "",
        "| flight | samples | lidar profiles | matched | file | SHA-256 |",
        "|---|---|---|---|---|---|",
    ]
    for name, f in record.get("flights", {}).items():
        c, m = f.get("counts", {}), f.get("match", {})
        files = list(f.get("files", {}).values()) or [{"name": "-", "sha256": "-"}]
        for i, info in enumerate(files):
            lead = (
                [
                    name,
                    str(f.get("samples", "-")),
                    str(c.get("profiles", "-")),
                    f"{m.get('matched', '-')} of {m.get('inside_camera', '-')}",
                ]
                if i == 0
                else ["", "", "", ""]
            )
            out.append("| " + " | ".join(lead + [f"`{info['name']}`", f"`{info['sha256']}`"]) + " |")
    return out + [
        "",
        "The whole record (counts by filter, match statistics, file sizes): `provenance.json`.",
        "",
    ]
