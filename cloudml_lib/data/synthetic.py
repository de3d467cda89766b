"""Built-in demo flights, written in the real ER-2 three-file layout, keys and units.

The demo exercises the same loading code as real flights, so the generator writes what the real
files hold: an IRAI L1B file of thermal-IR frames with a UTC time per frame, a CPL L2 layer file
with decimal Julian days and layer base altitudes, and a navigation file with solar angles.

The scene (all sizes scale with the frame width; "px" is one camera pixel at nadir):
- A cloud layer with a known base height h(t) (km) that drifts slowly along the flight, and a
  random cloud field (smoothed noise, soft edges) attached to that layer.
- The camera flies at 20 km, 200 m/s, one frame per second. A point of the cloud layer appears
  magnified by H / (H - h) and moves across the frame faster than the sea surface, by the same
  factor: the apparent motion between consecutive frames depends on h (parallax).
- The sun, at zenith angle sza and azimuth saa, casts each cloud's shadow on the sea,
  displaced by h * tan(sza) away from the sun: the shadow offset depends on h and the angles.
- Brightness temperature: a warm sea (about 290 K, with a gentle gradient), cooled by 1.5 K in
  shadow; cloud pixels at the cloud's own temperature, colder with height (6.5 K/km lapse rate);
  sensor noise of 0.15 K.
- Flights differ in sun angles and height distribution, so a held-out flight is a real test and
  a model that sees only the angles cannot predict the height.
- The lidar labels are h(t) sampled every 2 s plus 20 m of noise, with invalid profiles that
  the loader's filters must remove: no layer (-9999), over land (DEM > 0), a lidar surface
  altitude above 0.9 km, heights outside 0.1..2 km, and profiles outside the camera's time span.
- About 1% of the solar zenith values are NaN, as in real navigation data.
"""
from __future__ import annotations

import datetime as dt
import logging
from pathlib import Path

import h5py
import numpy as np
from scipy import ndimage
from tqdm.auto import tqdm

log = logging.getLogger(__name__)

AIRCRAFT_ALTITUDE_KM = 20.0
AIRCRAFT_SPEED_KM_S = 0.2
SWATH_KM = 24.0
LAPSE_RATE_K_PER_KM = 6.5
MONTHS = ("jan", "feb", "mar", "apr", "may", "jun", "jul", "aug", "sep", "oct", "nov", "dec")

# Per-flight sun and height settings: (sza centre deg, saa centre deg, mean height km).
# Spread so that the held-out flight (the third) lies inside the training flights' range.
FLIGHT_SETTINGS = (
    (28.0, 135.0, 0.75), (55.0, 210.0, 1.05), (42.0, 160.0, 0.95),
    (35.0, 240.0, 1.20), (48.0, 120.0, 0.70), (32.0, 190.0, 0.90),
    (58.0, 150.0, 1.10), (45.0, 225.0, 0.80),
)
DEMO_VALIDATION_INDEX = 2
DEMO_FLIGHTS, DEMO_SEED = 5, 0
DEMO_FRAME_SHAPE = (80, 96)          # raw sensor rows x columns of the demo camera


def demo_flight_names(n_flights: int, start: dt.date = dt.date(2025, 3, 1)) -> list[tuple[str, dt.date]]:
    dates = [start + dt.timedelta(days=2 * i) for i in range(n_flights)]
    return [(d.strftime("%d%b%y"), d) for d in dates]


def demo_flight_entries(n_flights: int) -> list[dict]:
    """The `data.flights` entries of the demo flights (file names in the real naming style)."""
    entries = []
    for i, (name, date) in enumerate(demo_flight_names(n_flights)):
        cpl_date = f"{date.day:02d}{MONTHS[date.month - 1]}{date.year % 100:02d}"
        entries.append({
            "name": name,
            "ir_file": f"DEMO_IRAI_L1B_Rev-_{date:%Y%m%d}.h5",
            "cpl_file": f"CPL_L2_V1-02_01kmLay_{900001 + i}_{cpl_date}.hdf5",
            "nav_file": f"CRS_{date:%Y%m%d}_nav.hdf",
        })
    return entries


def _smooth_series(rng: np.random.Generator, n: int, sigma: float) -> np.ndarray:
    """Zero-mean, unit-std noise smoothed over `sigma` samples."""
    x = ndimage.gaussian_filter1d(rng.standard_normal(n + 6 * int(sigma)), sigma)[3 * int(sigma):][:n]
    return (x - x.mean()) / (x.std() + 1e-9)


def _cloud_field(rng: np.random.Generator, shape: tuple[int, int], scale_px: float) -> np.ndarray:
    """Cloud opacity in [0, 1]: thresholded smooth noise with soft edges, about 40% cover."""
    noise = ndimage.gaussian_filter(rng.standard_normal(shape), scale_px)
    noise = (noise - noise.mean()) / noise.std()
    return 1.0 / (1.0 + np.exp(-(noise - 0.25) / 0.12))


def _render_flight(rng, n_frames: int, rows: int, cols: int, sza_deg, saa_deg, height_km):
    """Brightness-temperature frames (n, rows, cols) in K for one flight."""
    px_km = SWATH_KM / cols
    speed_px = AIRCRAFT_SPEED_KM_S / px_km
    max_shadow_px = 2.5 * np.tan(np.radians(65.0)) / px_km
    margin = int(max_shadow_px) + 8
    canvas = (int(n_frames * speed_px) + rows + 2 * margin, cols + 2 * margin)
    field = _cloud_field(rng, canvas, scale_px=cols / 24.0)
    u_r, u_c = np.meshgrid(np.arange(rows) - rows / 2, np.arange(cols) - cols / 2, indexing="ij")
    centre_r, centre_c = margin + rows / 2, margin + cols / 2
    sea = 290.0 + 0.8 * (u_c / cols) + 0.5 * (u_r / rows)
    frames = np.empty((n_frames, rows, cols), np.float32)
    for k in range(n_frames):
        h = float(height_km[k])
        cam = centre_r + k * speed_px
        # The cloud layer is nearer the camera: magnified, and it moves faster (parallax).
        shrink = (AIRCRAFT_ALTITUDE_KM - h) / AIRCRAFT_ALTITUDE_KM
        cloud = ndimage.map_coordinates(field, [cam + u_r * shrink, centre_c + u_c * shrink], order=1)
        # Shadow on the sea at ground point g comes from the cloud at g + d toward the sun.
        d_px = h * np.tan(np.radians(sza_deg[k])) / px_km
        az = np.radians(saa_deg[k])
        shadow = ndimage.map_coordinates(field, [cam + u_r - d_px * np.cos(az), centre_c + u_c + d_px * np.sin(az)],
                                         order=1)
        t_cloud = 290.0 - 1.0 - LAPSE_RATE_K_PER_KM * (h + 0.3)
        ground = sea - 1.5 * shadow
        frames[k] = (1 - cloud) * ground + cloud * t_cloud + rng.normal(0.0, 0.15, (rows, cols))
    return frames


def _write_flight(out: Path, entry: dict, date: dt.date, index: int, rng: np.random.Generator,
                  n_frames: int, rows: int, cols: int) -> None:
    sza_c, saa_c, h_mean = FLIGHT_SETTINGS[index % len(FLIGHT_SETTINGS)]
    if index >= len(FLIGHT_SETTINGS):
        sza_c, saa_c, h_mean = sza_c + rng.uniform(-4, 4), saa_c + rng.uniform(-20, 20), h_mean + rng.uniform(-.1, .1)
    t0 = 64800.0 + 600.0 * index  # seconds of day: 18:00 UTC and later
    frame_t = t0 + np.arange(n_frames) + rng.uniform(-0.02, 0.02, n_frames)
    height = np.clip(h_mean + 0.38 * _smooth_series(rng, n_frames, 6.0), 0.05, 2.3)
    sza = sza_c + 3.0 * _smooth_series(rng, n_frames, 40.0)
    saa = (saa_c + 8.0 * _smooth_series(rng, n_frames, 40.0)) % 360.0
    frames = _render_flight(rng, n_frames, rows, cols, sza, saa, height)

    with h5py.File(out / entry["ir_file"], "w") as f:
        f.create_dataset("Product/Signal", data=frames, chunks=(1, rows, cols))
        f["Product/Signal"].attrs["units"] = "K"
        f.create_dataset("Time/TimeUTC", data=frame_t)
        f["Time/TimeUTC"].attrs["units"] = "seconds of day, UTC"

    # Lidar profiles every 2 s, starting 20 s before the camera and ending 20 s after it.
    prof_t = np.arange(t0 - 20.0, t0 + n_frames + 20.0, 2.0) + rng.uniform(-0.15, 0.15)
    n_prof = prof_t.size
    frame_of = np.clip(np.round(prof_t - t0).astype(int), 0, n_frames - 1)
    base = np.full((n_prof, 10), -9999.0, np.float32)
    base[:, 0] = height[frame_of] + rng.normal(0.0, 0.02, n_prof)
    base[:, 1] = np.where(rng.random(n_prof) < 0.3, base[:, 0] + 3.0, -9999.0)
    dem = np.zeros(n_prof, np.float32)
    lidar_surface = rng.normal(0.0, 30.0, n_prof).astype(np.float32)
    bad = rng.random(n_prof)
    base[bad < 0.05, 0] = -9999.0                                     # no layer found
    dem[(bad >= 0.05) & (bad < 0.09)] = 150.0                         # over land
    lidar_surface[(bad >= 0.09) & (bad < 0.12)] = 1500.0              # surface return too high
    base[(bad >= 0.12) & (bad < 0.14), 0] = 2.6                       # out of the label range
    doy = date.timetuple().tm_yday
    julian = doy + prof_t / 86400.0
    with h5py.File(out / entry["cpl_file"], "w") as f:
        g = f.create_group("layer_descriptor")
        g.create_dataset("Profile_Decimal_Julian_Day", data=julian)
        g.create_dataset("Layer_Base_Altitude", data=base)
        g.create_dataset("Lidar_Surface_Altitude", data=lidar_surface)
        g.create_dataset("DEM_Surface_Altitude", data=dem)

    # Navigation at 1 Hz on its own clock, covering the camera's span with a margin.
    nav_t = np.arange(t0 - 30.0, t0 + n_frames + 30.0, 1.0)
    idx = np.clip(np.round(nav_t - t0).astype(int), 0, n_frames - 1)
    nav_sza = sza[idx].astype(np.float64)
    nav_sza[rng.random(nav_sza.size) < 0.01] = np.nan
    heading = np.radians(saa_c + 90.0)
    dist_km = (nav_t - t0) * AIRCRAFT_SPEED_KM_S
    with h5py.File(out / entry["nav_file"], "w") as f:
        g = f.create_group("nav")
        g.create_dataset("Time", data=nav_t)
        g.create_dataset("solarZenith", data=nav_sza)
        g.create_dataset("sunAzGrd", data=saa[idx].astype(np.float64))
        g.create_dataset("IWG_lat", data=20.0 + dist_km * np.cos(heading) / 111.0)
        g.create_dataset("IWG_lon", data=-150.0 + dist_km * np.sin(heading) / 104.0)


def make_demo_flights(out_dir: str | Path, n_flights: int = 5, seed: int = 0, frames_per_flight: int = 360,
                      frame_shape: tuple[int, int] = DEMO_FRAME_SHAPE) -> list[dict]:
    """Write `n_flights` demo flights into `out_dir`; returns their `data.flights` entries."""
    if n_flights < 2:
        raise ValueError(f"--flights must be at least 2 (one to train on, one to hold out), got {n_flights}")
    rows, cols = frame_shape
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    entries = demo_flight_entries(n_flights)
    names = demo_flight_names(n_flights)
    for i in tqdm(range(n_flights), desc="demo flights", unit="flight"):
        rng = np.random.default_rng([seed, i])
        _write_flight(out, entries[i], names[i][1], i, rng, frames_per_flight, rows, cols)
    log.info("wrote %d demo flights (%d frames of %dx%d each) to %s", n_flights, frames_per_flight, rows, cols, out)
    return entries


def demo_files_present(data_dir: str | Path, entries: list) -> bool:
    d = Path(data_dir)
    return all((d / getattr(e, key)).is_file() for e in entries for key in ("ir_file", "cpl_file", "nav_file"))


def ensure_demo_flights(data) -> None:
    """With `data.demo`, fill in the demo flights when none are listed and write any that are missing."""
    from cloudml_lib.config import FlightConfig   # local: config does not depend on the data package

    if not data.demo:
        return
    if not data.flights:
        data.flights = [FlightConfig(**e) for e in demo_flight_entries(DEMO_FLIGHTS)]
    if not data.validation_flights:
        data.validation_flights = [data.flights[min(DEMO_VALIDATION_INDEX, len(data.flights) - 1)].name]
    if not demo_files_present(data.dir, data.flights):
        log.info("data.demo: generating %d demo flights into %s", len(data.flights), data.dir)
        make_demo_flights(data.dir, n_flights=len(data.flights), seed=DEMO_SEED)
