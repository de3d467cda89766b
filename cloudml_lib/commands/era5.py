"""`fetch-era5`: ERA5 for the user's flights from the Copernicus Climate Data Store, with the user's own key.

For each flight: its track (IR times, nav positions), the box and hours around it, one request per UTC day
and dataset (data/era5_requests.py), each written into the flight's folder as
`ERA5_<levels>_<flight>_<day>.nc`, where data/era5.py finds it. A file already there is kept (a second run
fetches only what is missing); a download goes to a temporary file beside its target, is read back as ERA5
(era5.read_file: its layout, units and ranges), and only then takes its name, which it never takes from
another file.

The CDS client (`cdsapi`) is optional, named with its install command where the user is. The key: the
client's own places (`~/.cdsapirc`, or CDSAPI_URL and CDSAPI_KEY in the environment) or, on Colab, the
notebook's secret CDSAPI_KEY (google.colab.userdata); it is passed to the client only, never written to a
file or a log."""

from __future__ import annotations

import logging
import os
import tempfile
from pathlib import Path

from cloudml_lib.base.config import Config
from cloudml_lib.base.errors import CloudMLError, DataError, install_command
from cloudml_lib.data import er2, era5, era5_requests

log = logging.getLogger(__name__)

CDS_URL = "https://cds.climate.copernicus.eu/api"
KEY_HELP = (
    "a Climate Data Store key: sign in at https://cds.climate.copernicus.eu, accept the ERA5 licences, and "
    "put `url: https://cds.climate.copernicus.eu/api` and `key: <your key>` in ~/.cdsapirc (or CDSAPI_URL "
    "and "
    "CDSAPI_KEY in the environment; on Colab, a notebook secret named CDSAPI_KEY)"
)


CDSAPI = "cdsapi>=0.7"  # as pyproject.toml's era5 extra


def has_rc() -> bool:
    """Whether the CDS client's own key file is there (CDSAPI_RC, or ~/.cdsapirc)."""
    return Path(os.environ.get("CDSAPI_RC", Path.home() / ".cdsapirc")).is_file()


def colab_key() -> str | None:
    """The notebook's secret CDSAPI_KEY on Colab (google.colab.userdata), else None."""
    try:
        from google.colab import userdata  # type: ignore[import-not-found]
    except ImportError:
        return None
    try:
        return userdata.get("CDSAPI_KEY") or None
    except Exception:  # noqa: BLE001 - no such secret, or access not granted: the other places are asked
        return None


def cds_client():
    """The CDS client with the user's key; CloudMLError saying what to do without the client or a key."""
    try:
        import cdsapi  # type: ignore[import-not-found]
    except ImportError:
        raise CloudMLError(
            f"fetching ERA5 needs the Climate Data Store's client: {install_command(CDSAPI)}, then {KEY_HELP}"
        ) from None
    key = colab_key()
    if key is None and not os.environ.get("CDSAPI_KEY") and not has_rc():
        raise CloudMLError(f"no Climate Data Store key was found: {KEY_HELP}")
    if key is not None:
        return cdsapi.Client(url=os.environ.get("CDSAPI_URL", CDS_URL), key=key, quiet=True)
    return cdsapi.Client(quiet=True)


def flight_folder(flight, data) -> Path:
    return er2.flight_paths(flight, data)["ir"].parent


def plan(cfg: Config, names: list[str] | None = None, levels: bool = True) -> list[tuple[str, Path, object]]:
    """(flight, target path, request) for every request of the config's flights (or `names`)."""
    from cloudml_lib.data.flights import resolve_config

    cfg, _ = resolve_config(cfg, check_names=False)  # every flight, test flights named or not
    flights = [f for f in cfg.data.flights if not names or f.name in names]
    unknown = sorted(set(names or []) - {f.name for f in cfg.data.flights})
    if unknown:
        valid = ", ".join(f.name for f in cfg.data.flights)
        raise DataError(f"--flights: {', '.join(unknown)} not among the flights found ({valid})")
    out = []
    for flight in flights:
        t, lat, lon = era5_requests.flight_track(flight, cfg.data)
        folder = flight_folder(flight, cfg.data)
        for request in era5_requests.flight_requests(flight.name, t, lat, lon, levels):
            out.append((flight.name, folder / request.target, request))
    return out


def fetch(cfg: Config, names=None, levels: bool = True, dry_run: bool = False, client=None) -> dict:
    """Fetch what is missing; returns {"fetched": [...], "kept": [...], "planned": [...]} (paths)."""
    planned = plan(cfg, names, levels)
    done = {"fetched": [], "kept": [], "planned": [str(p) for _, p, _ in planned]}
    missing = [(f, p, r) for f, p, r in planned if not (p.exists() or p.is_symlink())]
    for flight, path, request in planned:
        if (flight, path, request) not in missing:
            era5.read_file(path)  # a file of that name is there: it must be ERA5 (else named, never replaced)
            done["kept"].append(str(path))
            log.info("flight %s: %s is there already: kept", flight, path.name)
    if dry_run or not missing:
        return done
    client = client or cds_client()
    for flight, path, request in missing:
        log.info(
            "flight %s: requesting %s from the Climate Data Store (%s)", flight, path.name, request.dataset
        )
        fd, temp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".partial")
        os.close(fd)
        try:
            client.retrieve(request.dataset, request.keys, temp)
            # what was served is ERA5 of CDS's layout, in range, before it is named (read once: not kept)
            era5.read_file(Path(temp), keep=False)
            os.link(temp, path)  # never over a file that appeared meanwhile
        finally:
            os.unlink(temp)
        done["fetched"].append(str(path))
    return done
