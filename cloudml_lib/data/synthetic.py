"""Built-in demo flights, written in the layout, keys, shapes and units of the users' real ER-2 files.

The demo exercises the same loading code as real flights, so the generator writes what the real
files hold (ER2_DATA.md, "Corrections from public evidence"):
- one folder per flight (`05Mar25/`), with an IRAI L1B file whose name may carry a revision
  suffix (`GLOVE2025_IRAI_L1B_Rev-_20250305-003.h5`), a CPL L2 layer file and a navigation file;
- IR frames as big-endian unsigned 16-bit counts (100 counts per kelvin above 180 K) and
  `Time/TimeUTC` in Unix epoch seconds, on some flights longer than the frames, with a stray 0 or
  fill value;
- CPL `Profile_Decimal_Julian_Day` (N, 3) (start, centre, end of a ~5 s profile), `File_Year` as a
  byte string (`b'2025'`), the second flight crossing 00 UTC (its day of year goes past the next day),
  `Layer_Base_Altitude` / `Layer_Top_Altitude` (N, 10) km with layer 0 on top, `Number_Layers`,
  `Lidar_Surface_Altitude` in km, the sun angles and position per profile, a few duplicated
  profiles;
- a nav file with no time axis (row i = frame i), longer or shorter than the frames, about 1%
  NaN solar zenith angles, and the aircraft's true heading (`nav/trueHdg`); one flight's nav is
  public-style ICARTT text instead (`*_MetNav_ER2_YYYYMMDD_R0.ict`, with a time axis, a Day_Of_Year
  column, the sun azimuth in -180..180, fill -9999 and the limit-of-detection flags -7777 / -8888).

The scene of generator versions 3 and 4 (4 is `make_demo_flights`' default; all sizes scale with the frame
width; "px" is one camera pixel at nadir). What the camera sees of a low cloud is its *top*; the lidar labels
its *base*, a thickness below, and nothing in one frame's temperatures gives that thickness, the sea's
temperature under an overcast or the day's lapse rate, so no temperature statistic gives the base exactly:
- A marine boundary layer per flight (`Atmosphere`): the sea's temperature differs between flights (285.5 to
  292 K, the range of sea surface temperatures off California in NOAA's OISST climatology, about 12-19 C), the
  air at the surface 0.5-1.5 K cooler than the sea (a typical marine air-sea difference), and the temperature
  falls with height at a rate between 7 K/km (a decoupled, partly stable sub-cloud layer) and 9.8 K/km (the
  dry adiabat of a well-mixed one) below the cloud base, then at 5 K/km (about the moist adiabat at these
  temperatures) inside the cloud, so the cloud top is colder than the base by 5 K per km of thickness.
- A low cloud with a known base height h(t) (km) that drifts along the flight, present in bursts separated by
  clear stretches, so labels come in bursts with long gaps; its thickness varies within a flight (a smooth
  +-35% around the flight's mean) and between flights (means 0.20-0.42 km): stratocumulus thickness is close
  to normally distributed over the eastern Pacific, a few hundred metres (Zhou et al. 2006, GRL 33, L02807;
  Wood 2012, Mon. Wea. Rev. 140, 2373, reviews 100-500 m). Its random cloud field (smoothed noise, soft edges)
  moves with the layer. A thin cloud is partly transparent in the infrared: its emissivity is 1 - exp(-0.158
  LWP) (Stephens 1978, J. Atmos. Sci. 35, 2123, LWP in g/m2), the liquid water path that of a cloud at 60% of
  the adiabatic liquid water content (1000 x 0.6 x thickness_km^2 g/m2), so a 50 m thin cloud shows about a
  fifth of the temperature contrast of a thick one.
- Stretches of thin cirrus at 8-11 km (layer 0, the top) come and go independently of the low cloud, over
  about 40% of a flight: a faint, streaky veil in the frames (emissivity 0.01-0.04, so one to three kelvin
  colder), over the low cloud or over clear sea. Its base is the users' `top` label; the low cloud's base is
  the `lowest` label (the default). A third of the cirrus-free low-cloud profiles see a second low layer
  0.2-0.8 km above the low cloud (also layer 0), so `top` and `single` differ, as on the real flights (933
  against ~380 labels).
- Cloud / no-cloud (`Number_Layers == 0` is clear sky) is of varying difficulty: clear sea (easy against low
  cloud), faint cirrus alone (cloud, but no height in the label range: hard), and low cloud under cirrus.
- The camera flies at 20 km, 200 m/s, one frame per second. A point of the cloud's top appears magnified by
  H / (H - top) and moves across the frame faster than the sea surface, by the same factor (parallax).
- The aircraft flies straight legs joined by turns, so its heading changes along a flight. The sun, at zenith
  angle sza and azimuth saa from north, casts the cloud's shadow on the sea: the slab from base to top shades
  the sea from base * tan(sza) to top * tan(sza) away from the sun, in the direction of saa - heading in the
  image, so the shadow's offset carries the base and its width the thickness, both seen only with the sun's
  angles; a flip that mirrored the azimuth as if the aircraft headed north would teach wrong shadow
  directions.
- Brightness temperature: the sea (with a gentle gradient across the frame), cooled by 1.5 K in shadow; cloud
  pixels at the cloud top's temperature, mixed with what lies below by the emissivity; sensor noise of 0.15 K.
- Flights differ in sun angles, height and thickness, sea and air: a test flight is a real test, a model that
  sees only the angles cannot predict the height, and one that reads the temperature must also know the day's
  atmosphere, as on real flights.
- Lidar heights (the low layer's base and top) come in 30 m steps, with 20 m of noise before rounding, and
  with invalid profiles the loader's filters must remove: no layer, over land (DEM > 0), a surface altitude
  fill value or above 0.9 km, heights outside 0.1..2 km, and profiles outside the camera's time span.
- The IR file says what its numbers are: counts packed as CF-1.8 does (`units` K, `scale_factor` 0.01,
  `add_offset` 180: a count is 0.01 K above 180 K), and which generator wrote it (`cloudml_demo_generator`).

Generator version 4 is version 3's flights (the same frames, labels and nav, byte for byte but the IR file's
`cloudml_demo_generator`) with the ERA5 reanalysis of their atmosphere beside them, as fetch-era5 would
download it (demo_era5.py: its physics, its errors and their sources):
- in each flight's folder, `ERA5_single_<flight>_<YYYYMMDD>.nc` and `ERA5_pressure_<flight>_<YYYYMMDD>.nc`
  for each UTC day the flight touches (two pairs for the flight across 00 UTC), named, boxed (0.25 degree
  grid) and timed (hourly) as era5_requests asks the Climate Data Store for them; the legacy CDS layout
  (NetCDF-3, packed 16-bit values) on the second of every three flights (of five: the second and fifth),
  the 2024 one (NetCDF-4) on the others;
- the truth behind them is the atmosphere that makes the frames, as a 0.25 degree hourly field holds it: the
  flight's sea (with a gentle gradient) and air, its lapse rates to the cloud's mean base and through the
  cloud to its mean top, an inversion of 6-12 K above the top (BOUNDARY_LAYERS), the free troposphere at
  6.5 K/km, and a 2 m dew point whose lifting condensation level (Romps 2017) is the cloud's mean base where
  the boundary layer is coupled and 0.25-0.40 km below it on the decoupled flights (the second, fourth and
  seventh: those whose sub-cloud lapse rate is 7-8 K/km, well below the dry adiabat). Coupled and decoupled
  stratocumulus-topped layers are both common (observed in VOCALS-REx by Jones, Bretherton and Leon 2011,
  ACP 11, 7143; reviewed by Wood 2012, MWR 140, 2373: a decoupled layer's cloud base lies above the surface
  air's condensation level); a mixed-layer model decouples subtropical stratocumulus layers except near
  the coast, where they are under about 750 m deep (Bretherton and Wyant 1997, JAS 54, 148). The offsets
  of 0.25-0.40 km are our choice within that picture, not a published distribution. The boundary layer
  height is the cloud top's. The base's drift along the flight is not in the field: neither the frames
  alone nor the reanalysis alone gives the base exactly;
- the reanalysis differs from that truth by a per-flight bias plus a smooth field, of the sizes published
  for ERA5 where a figure was found and assumed otherwise (demo_era5.ERRORS), drawn from a random stream of
  the flight's own (`[seed, flight, 4]`), so that the frames, labels and nav draw exactly version 3's
  numbers.

Generator version 2 (CloudML 0.2-0.3; `make_demo_flights(version=2)` writes it again, byte for byte, for the
runs made on it): every cloud pixel at the temperature of its base + 0.3 km (a constant thickness, one sea
temperature for all flights and 6.5 K/km from 289 K at the surface up), so the frames' coldest pixels gave the
base almost exactly and the demo was easy by construction; its IR files state only `units: counts`. Version 1
(before it) had neither cirrus nor clear sky in the frames.
"""

from __future__ import annotations

import calendar
import datetime as dt
import logging
from dataclasses import dataclass, replace
from pathlib import Path

import h5py
import numpy as np
from tqdm.auto import tqdm

from cloudml_lib.base import ledger
from cloudml_lib.base.config import DataConfig
from cloudml_lib.base.errors import CloudMLError
from cloudml_lib.base.ownership import Kind, claim
from cloudml_lib.data import demo_era5, flights, times
from cloudml_lib.data.demo import DEMO_FLIGHTS, DEMO_TEST_INDEX, demo_flight_names, demo_test_flights  # noqa: F401
from cloudml_lib.data.demo_era5 import ndimage
from cloudml_lib.data.hdf5 import holds_dataset

log = logging.getLogger(__name__)

AIRCRAFT_ALTITUDE_KM = 20.0
AIRCRAFT_SPEED_KM_S = 0.2
SWATH_KM = 24.0
LAPSE_RATE_K_PER_KM = 6.5
CIRRUS_K = 225.0  # cirrus at 8-11 km
COUNTS_PER_K, COUNTS_ZERO_K = 100.0, 180.0  # IR counts = 100 x (T - 180 K), big-endian uint16
PROFILE_SPACING_S = 5.0  # one averaged CPL profile every ~5 s (1 km)
REVISIONS = ("-003", "", "-005", "-008", "-003")  # IR file name suffixes, as in the users' folders

# Per-flight sun and height settings: (sza centre deg, saa centre deg, mean height km).
# Spread so that the test flight (the third) lies inside the training flights' range.
FLIGHT_SETTINGS = (
    (28.0, 135.0, 0.75),
    (55.0, 210.0, 1.05),
    (42.0, 160.0, 0.95),
    (35.0, 240.0, 1.20),
    (48.0, 120.0, 0.70),
    (32.0, 190.0, 0.90),
    (58.0, 150.0, 1.10),
    (45.0, 225.0, 0.80),
)
# 2: cirrus in the frames, low cloud of varying opacity (cloud / no-cloud); 3: the cloud's top in the frames,
# its base a varying thickness below, the atmosphere of each flight its own; 4: 3's flights with the ERA5
# reanalysis of their atmosphere beside them (the module's docstring)
DEMO_VERSION = 4
DEMO_VERSIONS = (2, 3, 4)  # the versions make_demo_flights writes (2 and 3 byte for byte as before)
VERSION_FILE = ".cloudml_demo_version"  # written beside the flights; an earlier version's flights are kept
GENERATOR_ATTR = "cloudml_demo_generator"  # the IR file's attribute naming its generator version (3 on)
# Version 3's flights, one entry each (cycled past the eighth): the sea's temperature (K), the air's
# difference to it at the surface (K), the sub-cloud lapse rate (K/km) and the low cloud's mean thickness (km)
ATMOSPHERES = (
    (289.0, 1.0, 9.0, 0.30),
    (286.5, 0.6, 8.0, 0.22),
    (291.0, 1.2, 9.5, 0.34),
    (288.0, 0.8, 7.5, 0.26),
    (290.5, 1.4, 8.5, 0.38),
    (287.0, 0.5, 9.8, 0.20),
    (292.0, 1.1, 7.0, 0.42),
    (285.5, 0.9, 8.8, 0.28),
)
# Version 4's flights (cycled as ATMOSPHERES): how far the cloud base lies above the lifting condensation
# level of the surface air (km; 0: a coupled, well-mixed layer; the decoupled ones are flights whose sub-cloud
# lapse rate is well below the dry adiabat) and the inversion above the cloud top (K)
BOUNDARY_LAYERS = (
    (0.00, 9.0),
    (0.30, 7.0),
    (0.00, 11.0),
    (0.25, 6.0),
    (0.00, 10.0),
    (0.00, 12.0),
    (0.40, 8.0),
    (0.00, 9.0),
)
MOIST_LAPSE_K_PER_KM = 5.0  # inside the cloud (about the moist adiabat at 280-290 K)
ADIABATIC_FRACTION = 0.6  # the cloud's liquid water against the adiabatic profile (sub-adiabatic)
ABSORPTION_M2_PER_G = 0.158  # longwave emissivity 1 - exp(-a LWP) of a water cloud (Stephens 1978)
SHADOW_SLICES = 3  # heights between base and top whose shadows make the slab's
DEMO_SEED, DEMO_FRAMES = 0, 1400
DEMO_FRAME_SHAPE = (80, 96)  # raw sensor rows x columns of the demo camera
ICARTT_NAV_INDEX = 4  # this demo flight's navigation is ICARTT text with a time axis


def demo_flight_entries(n_flights: int, dates: list[dt.date] | None = None) -> list[dict]:
    """The `data.flights` entries of the demo flights: one folder per flight, real naming style."""
    entries = []
    for i, (name, date) in enumerate(demo_flight_names(n_flights, dates)):
        cpl_date = times.cpl_file_date(date)
        campaign = "GLOVE2025" if date.year >= 2025 else "WHYMSIE2024"
        entries.append(
            {
                "name": name,
                "ir_file": f"{name}/{campaign}_IRAI_L1B_Rev-_{date:%Y%m%d}{REVISIONS[i % len(REVISIONS)]}.h5",
                "cpl_file": f"{name}/CPL_L2_V1-02_01kmLay_{900001 + i}_{cpl_date}.hdf5",
                "nav_file": (
                    f"{name}/{campaign}_MetNav_ER2_{date:%Y%m%d}_R0.ict"
                    if i == ICARTT_NAV_INDEX
                    else f"{name}/CRS_{date:%Y%m%d}_nav.hdf"
                ),
            }
        )
    return entries


def _smooth_series(rng: np.random.Generator, n: int, sigma: float) -> np.ndarray:
    """Zero-mean, unit-std noise smoothed over `sigma` samples."""
    x = ndimage().gaussian_filter1d(rng.standard_normal(n + 6 * int(sigma)), sigma)[3 * int(sigma) :][:n]
    return (x - x.mean()) / (x.std() + 1e-9)


def _cloud_field(rng: np.random.Generator, shape: tuple[int, int], scale_px: float) -> np.ndarray:
    """Cloud opacity in [0, 1]: thresholded smooth noise with soft edges, about 40% cover."""
    noise = ndimage().gaussian_filter(rng.standard_normal(shape), scale_px)
    noise = (noise - noise.mean()) / noise.std()
    return 1.0 / (1.0 + np.exp(-(noise - 0.25) / 0.12))


def track_heading(rng: np.random.Generator, n: int, start_deg: float) -> np.ndarray:
    """True heading (degrees) per second: straight legs of 4-8 minutes joined by turns of 60-150 degrees at
    3 degrees per second, so the sun's azimuth relative to the aircraft changes along a flight."""
    rate = np.zeros(n)
    k = int(rng.integers(120, 300))
    while k < n:
        turn = rng.uniform(60.0, 150.0) * rng.choice([-1.0, 1.0])
        length = int(abs(turn) / 3.0)
        rate[k : k + length] = np.sign(turn) * 3.0
        k += length + int(rng.integers(240, 480))
    return (start_deg + np.cumsum(rate)) % 360.0


def scene_layers(
    field: np.ndarray, cam_row: float, rows: int, cols: int, h_km: float, sza_deg: float, rel_az_deg: float
) -> tuple[np.ndarray, np.ndarray]:
    """Cloud and shadow opacity (rows, cols) seen by the camera over `field`, the cloud layer in the
    aircraft's frame (rows along-track, the camera's centre column at the field's centre column).

    The cloud layer is nearer the camera than the sea: magnified by H / (H - h), and moving across the
    frame faster (parallax). Its shadow on the sea at ground point g comes from the cloud at g + d toward
    the sun, d = h tan(sza) in the direction of the sun azimuth *relative to the heading* (`rel_az_deg`,
    clockwise from the flight axis): the direction is fixed to the aircraft, so mirroring the image across
    the flight axis is the scene with the field mirrored and the relative azimuth negated."""
    u_r, u_c = _camera_grid(rows, cols)
    centre_c = (field.shape[1] - 1) / 2
    shrink = (AIRCRAFT_ALTITUDE_KM - h_km) / AIRCRAFT_ALTITUDE_KM
    cloud = ndimage().map_coordinates(field, [cam_row + u_r * shrink, centre_c + u_c * shrink], order=1)
    return cloud, shadow_layer(field, cam_row, rows, cols, h_km, sza_deg, rel_az_deg)


def _camera_grid(rows: int, cols: int) -> tuple[np.ndarray, np.ndarray]:
    """Each pixel's offset (rows, columns) from the frame's centre."""
    return np.meshgrid(np.arange(rows) - rows / 2, np.arange(cols) - (cols - 1) / 2, indexing="ij")


def shadow_layer(
    field: np.ndarray, cam_row: float, rows: int, cols: int, h_km: float, sza_deg: float, rel_az_deg: float
) -> np.ndarray:
    """scene_layers' shadow alone: the opacity of the cloud at `h_km` between the sun and each sea pixel."""
    px_km = SWATH_KM / cols
    u_r, u_c = _camera_grid(rows, cols)
    centre_c = (field.shape[1] - 1) / 2
    d_px = h_km * np.tan(np.radians(sza_deg)) / px_km
    az = np.radians(rel_az_deg)
    return ndimage().map_coordinates(
        field, [cam_row + u_r - d_px * np.cos(az), centre_c + u_c + d_px * np.sin(az)], order=1
    )


@dataclass
class Scene:
    """One flight's truth, frame by frame: the low cloud's base height (km) and opacity (0: none), the
    cirrus' emissivity (0: none), the sun's zenith and azimuth and the aircraft's heading (degrees), and
    (version 3) the low cloud's thickness (km; None: version 2's constant 0.3 km)."""

    height_km: np.ndarray
    cloudy: np.ndarray
    cirrus: np.ndarray
    sza: np.ndarray
    saa: np.ndarray
    heading: np.ndarray
    thickness_km: np.ndarray | None = None

    @property
    def n_frames(self) -> int:
        return self.height_km.size


@dataclass(frozen=True)
class Atmosphere:
    """A version-3 flight's marine boundary layer: the sea's temperature (K), how much cooler the air is at
    the surface (K), and the lapse rate below the cloud base (K/km; inside the cloud:
    MOIST_LAPSE_K_PER_KM)."""

    sea_k: float
    air_sea_k: float
    lapse_k_per_km: float

    def top_k(self, base_km, thickness_km):
        """The temperature (K) of a cloud's top: the air at the surface, cooled up to the base and through the
        cloud."""
        surface = self.sea_k - self.air_sea_k
        return surface - self.lapse_k_per_km * base_km - MOIST_LAPSE_K_PER_KM * thickness_km


def emissivity(thickness_km):
    """A water cloud's longwave emissivity from its thickness (the module's docstring: sub-adiabatic liquid
    water, Stephens' absorption coefficient)."""
    lwp = 1000.0 * ADIABATIC_FRACTION * np.square(thickness_km)  # g/m2
    return 1.0 - np.exp(-ABSORPTION_M2_PER_G * lwp)


def slab_layers(field: np.ndarray, cam_row: float, rows: int, cols: int, scene: Scene, k: int):
    """Version 3's scene_layers: the cloud as its top is seen, and the shadow of the whole slab from base to
    top (the sea shaded wherever the sun's ray crosses the cloud at any of SHADOW_SLICES heights)."""
    base, thick = float(scene.height_km[k]), float(scene.thickness_km[k])
    sza, rel_az = float(scene.sza[k]), float((scene.saa[k] - scene.heading[k]) % 360.0)
    cloud, shadow = scene_layers(field, cam_row, rows, cols, base + thick, sza, rel_az)
    for h in np.linspace(base, base + thick, SHADOW_SLICES)[:-1]:
        shadow = np.maximum(shadow, shadow_layer(field, cam_row, rows, cols, h, sza, rel_az))
    return cloud, shadow


def _render_flight_v3(rng, scene: Scene, air: Atmosphere, rows: int, cols: int):
    """Version 3's brightness-temperature frames (n, rows, cols) in K: the cloud's top in the frames, its
    emissivity from its thickness, the slab's shadow (slab_layers), the flight's own sea and air."""
    px_km = SWATH_KM / cols
    speed_px = AIRCRAFT_SPEED_KM_S / px_km
    margin = int(3.0 * np.tan(np.radians(65.0)) / px_km) + 8
    canvas = (int(scene.n_frames * speed_px) + rows + 2 * margin, cols + 2 * margin)
    field = _cloud_field(rng, canvas, scale_px=cols / 24.0)
    u_r, u_c = np.meshgrid(np.arange(rows) - rows / 2, np.arange(cols) - cols / 2, indexing="ij")
    sea = air.sea_k + 0.8 * (u_c / cols) + 0.5 * (u_r / rows)
    top_k = air.top_k(scene.height_km, scene.thickness_km)
    opacity = scene.cloudy * emissivity(scene.thickness_km)
    frames = np.empty((scene.n_frames, rows, cols), np.float32)
    clear = np.zeros((rows, cols))
    for k in range(scene.n_frames):
        if scene.cloudy[k] == 0:  # no low cloud: neither it nor its shadow drawn (the same numbers, faster)
            cloud = shadow = clear
        else:
            cloud, shadow = slab_layers(field, margin + rows / 2 + k * speed_px, rows, cols, scene, k)
            cloud, shadow = opacity[k] * cloud, scene.cloudy[k] * shadow
        below = (1 - cloud) * (sea - 1.5 * shadow) + cloud * top_k[k]
        if scene.cirrus[k] > 0:
            below = _under_cirrus(field, below, scene.cirrus[k], margin + rows / 2 + k * speed_px, u_r, u_c)
        frames[k] = below + rng.normal(0.0, 0.15, (rows, cols))
    return frames


def _under_cirrus(field, below, cirrus: float, row: float, u_r, u_c):
    """The frame seen through a cirrus veil: streaks (the cloud field stretched along-track, far from the
    low cloud's part of it) of emissivity up to `cirrus` at CIRRUS_K."""
    streak = ndimage().map_coordinates(
        field,
        [(row + u_r * 0.25) % field.shape[0], (field.shape[1] - 1) / 2 - u_c * 1.5],
        order=1,
        mode="wrap",
    )
    emissivity_ = cirrus * (0.4 + 0.6 * streak)
    return (1 - emissivity_) * below + emissivity_ * CIRRUS_K


def _render_flight(rng, scene: Scene, rows: int, cols: int):
    """Version 2's brightness-temperature frames (n, rows, cols) in K for one flight (kept byte for byte)."""
    n_frames, height_km, cloudy, cirrus = scene.n_frames, scene.height_km, scene.cloudy, scene.cirrus
    sza_deg, rel_az_deg = scene.sza, (scene.saa - scene.heading) % 360.0
    px_km = SWATH_KM / cols
    speed_px = AIRCRAFT_SPEED_KM_S / px_km
    max_shadow_px = 2.5 * np.tan(np.radians(65.0)) / px_km
    margin = int(max_shadow_px) + 8
    canvas = (int(n_frames * speed_px) + rows + 2 * margin, cols + 2 * margin)
    field = _cloud_field(rng, canvas, scale_px=cols / 24.0)
    u_r, u_c = np.meshgrid(np.arange(rows) - rows / 2, np.arange(cols) - cols / 2, indexing="ij")
    sea = 290.0 + 0.8 * (u_c / cols) + 0.5 * (u_r / rows)
    frames = np.empty((n_frames, rows, cols), np.float32)
    for k in range(n_frames):
        h = float(height_km[k])
        cloud, shadow = scene_layers(
            field, margin + rows / 2 + k * speed_px, rows, cols, h, float(sza_deg[k]), float(rel_az_deg[k])
        )
        cloud, shadow = cloudy[k] * cloud, cloudy[k] * shadow
        t_cloud = 290.0 - 1.0 - LAPSE_RATE_K_PER_KM * (h + 0.3)
        ground = sea - 1.5 * shadow
        below = (1 - cloud) * ground + cloud * t_cloud
        if cirrus[k] > 0:  # streaks: the cloud field stretched along-track, far from the low cloud's part
            streak = ndimage().map_coordinates(
                field,
                [
                    (margin + rows / 2 + k * speed_px + u_r * 0.25) % field.shape[0],
                    (field.shape[1] - 1) / 2 - u_c * 1.5,
                ],
                order=1,
                mode="wrap",
            )
            emissivity = cirrus[k] * (0.4 + 0.6 * streak)
            below = (1 - emissivity) * below + emissivity * CIRRUS_K
        frames[k] = below + rng.normal(0.0, 0.15, (rows, cols))
    return frames


def _profiles(rng, t0: float, scene: Scene) -> dict:
    """CPL layer profiles every ~5 s from 20 s before the camera to 20 s after it, in the real shapes."""
    n_frames, height, cloudy, cirrus_frames = scene.n_frames, scene.height_km, scene.cloudy, scene.cirrus
    sza, saa = scene.sza, scene.saa
    t = np.arange(t0 - 20.0, t0 + n_frames + 20.0, PROFILE_SPACING_S) + rng.uniform(-0.3, 0.3)
    dup = np.flatnonzero(rng.random(t.size) < 0.02)  # duplicated profile times occur
    t = np.sort(np.concatenate([t, t[dup]]))
    n = t.size
    k = np.clip(np.round(t - t0).astype(int), 0, n_frames - 1)  # the frame under each profile
    base, top = np.full((n, 10), -9999.0, np.float32), np.full((n, 10), -9999.0, np.float32)
    low = np.round((height[k] + rng.normal(0.0, 0.02, n)) / 0.03) * 0.03  # 30 m steps
    cirrus = cirrus_frames[k] > 0
    cirrus_base = np.round(rng.uniform(8.0, 11.0, n) / 0.03) * 0.03
    has_low = cloudy[k] > 0
    n_layers = has_low.astype(np.int32) + cirrus
    # layer 0 is the top layer: the cirrus when present, then the low cloud
    base[cirrus, 0], top[cirrus, 0] = cirrus_base[cirrus], cirrus_base[cirrus] + 0.6
    j = cirrus.astype(int)
    rows = np.flatnonzero(has_low)
    if scene.thickness_km is None:  # version 2: a constant thickness
        base[rows, j[rows]], top[rows, j[rows]] = low[rows], low[rows] + 0.3
    else:
        thick = np.maximum(np.round(scene.thickness_km[k] / 0.03) * 0.03, 0.03)  # 30 m steps, as the base
        base[rows, j[rows]], top[rows, j[rows]] = low[rows], low[rows] + thick[rows]
    dem = np.zeros(n, np.float32)
    surface = rng.normal(0.0, 0.03, n).astype(np.float32)  # km
    bad = rng.random(n)
    n_layers[bad < 0.03] = 0  # no layer found
    base[bad < 0.03], top[bad < 0.03] = -9999.0, -9999.0
    dem[(bad >= 0.03) & (bad < 0.07)] = 150.0  # over land
    surface[(bad >= 0.07) & (bad < 0.09)] = 1.5  # surface return too high
    surface[(bad >= 0.09) & (bad < 0.10)] = -9999.0  # fill value
    out_of_range = has_low & (bad >= 0.10) & (bad < 0.12)
    base[out_of_range, j[out_of_range]] = 2.61  # above the label range
    # a second low layer 0.2-0.8 km above the low cloud on a third of its cirrus-free profiles: the users'
    # `top` label (layer 0) is then its base, and `single` drops the profile
    upper = has_low & ~cirrus & (n_layers == 1) & (rng.random(n) < 0.35)
    lift = rng.uniform(0.2, 0.8, n)
    base[upper, 1], top[upper, 1] = base[upper, 0], top[upper, 0]
    base[upper, 0] = np.round((base[upper, 0] + lift[upper]) / 0.03) * 0.03
    top[upper, 0] = base[upper, 0] + 0.2
    n_layers[upper] = 2
    half = PROFILE_SPACING_S / 2 / 86400.0
    return {
        "t": t,
        "base": base,
        "top": top,
        "n_layers": n_layers,
        "dem": dem,
        "surface": surface,
        "half_day": half,
        "sza": sza[k],
        "saa": saa[k],
    }


def _write_flight(
    out: Path,
    entry: dict,
    date: dt.date,
    index: int,
    rng: np.random.Generator,
    n_frames: int,
    shape,
    version: int = DEMO_VERSION,
) -> tuple[Scene, demo_era5.Track]:
    """One demo flight's files (IR, CPL, nav) in `out`; `shape`: the camera's (rows, columns); `version`: the
    generator's (DEMO_VERSIONS). Returns its scene and its frames' times and positions."""
    rows, cols = shape
    sza_c, saa_c, h_mean = FLIGHT_SETTINGS[index % len(FLIGHT_SETTINGS)]
    if index >= len(FLIGHT_SETTINGS):
        sza_c, saa_c, h_mean = (
            sza_c + rng.uniform(-4, 4),
            saa_c + rng.uniform(-20, 20),
            h_mean + rng.uniform(-0.1, 0.1),
        )
    midnight, t0 = flight_start(date, index, n_frames)
    frame_t = t0 + np.arange(n_frames) + rng.uniform(-0.02, 0.02, n_frames)
    height = np.clip(h_mean + 0.38 * _smooth_series(rng, n_frames, 6.0), 0.05, 2.3)
    cloudy = (_smooth_series(rng, n_frames, 40.0) > -0.45).astype(np.float64)  # bursts and clear gaps
    cirrus = np.where(
        _smooth_series(rng, n_frames, 50.0) > 0.25,
        0.01 + 0.03 / (1.0 + np.exp(-_smooth_series(rng, n_frames, 30.0))),
        0.0,
    )
    sza = sza_c + 3.0 * _smooth_series(rng, n_frames, 40.0)
    saa = (saa_c + 8.0 * _smooth_series(rng, n_frames, 40.0)) % 360.0
    heading = track_heading(rng, n_frames, (saa_c + 90.0 + rng.uniform(-30, 30)) % 360.0)
    scene = Scene(height, cloudy, cirrus, sza, saa, heading)
    if version >= 3:
        sea, air_sea, lapse, thickness = ATMOSPHERES[index % len(ATMOSPHERES)]
        thick = np.clip(thickness * (1.0 + 0.35 * _smooth_series(rng, n_frames, 20.0)), 0.04, 0.9)
        scene = replace(scene, thickness_km=thick)
        frames = _render_flight_v3(rng, scene, Atmosphere(sea, air_sea, lapse), rows, cols)
    else:
        frames = _render_flight(rng, scene, rows, cols)
    step = AIRCRAFT_SPEED_KM_S * np.stack([np.cos(np.radians(heading)), np.sin(np.radians(heading))], 1)
    north_east = np.cumsum(step, axis=0) - step[0]  # km from the first frame, per frame
    counts = np.clip(np.round((frames - COUNTS_ZERO_K) * COUNTS_PER_K), 0, 65535).astype(">u2")

    _write_ir(out / entry["ir_file"], counts, frame_t, index, version)
    p = _profiles(rng, t0, scene)
    _write_cpl(out / entry["cpl_file"], p, date, t0, north_east)
    nav = {
        "sza": sza,
        "saa": saa,
        "heading": heading,
        "lat": 34.0 + north_east[:, 0] / 111.0,
        "lon": -122.0 + north_east[:, 1] / 92.0,
    }
    if index == ICARTT_NAV_INDEX:
        write_icartt_nav(out / entry["nav_file"], date, frame_t - midnight, nav, rng)
    else:
        _write_hdf_nav(out / entry["nav_file"], nav, index, rng)
    return scene, demo_era5.Track(frame_t, nav["lat"], nav["lon"])


def flight_start(date: dt.date, index: int, n_frames: int) -> tuple[float, float]:
    """(00 UTC of `date`, the first frame's nominal time) in epoch seconds: 18:00 UTC and later; the second
    flight crosses 00 UTC half way. Frame k is taken within 0.02 s of t0 + k."""
    midnight = float(calendar.timegm(date.timetuple()))
    t0 = midnight + 64800.0 + 600.0 * index
    if index == 1:
        t0 = midnight + 86400.0 - n_frames // 2
    return midnight, t0


def era5_span(date: dt.date, index: int, n_frames: int) -> np.ndarray:
    """Epoch seconds around every frame of a flight (a second before the first, one after the last): the hours
    of its ERA5 files and so their names (one per UTC day) are known before the flight is written."""
    t0 = flight_start(date, index, n_frames)[1]
    return np.array([t0 - 1.0, t0 + n_frames])


def boundary_layer(index: int, scene: Scene) -> demo_era5.BoundaryLayer:
    """Version 4: the smooth large-scale state of a flight's atmosphere that its ERA5 files hold: its sea, air
    and lapse rates (ATMOSPHERES), its cloud's mean base and top, the condensation level of its surface air
    and its inversion (BOUNDARY_LAYERS), and its low cloud cover."""
    sea, air_sea, lapse, _ = ATMOSPHERES[index % len(ATMOSPHERES)]
    decoupling, inversion = BOUNDARY_LAYERS[index % len(BOUNDARY_LAYERS)]
    base = float(scene.height_km.mean())
    top = base + float(scene.thickness_km.mean())
    return demo_era5.BoundaryLayer(
        sea,
        air_sea,
        lapse,
        MOIST_LAPSE_K_PER_KM,
        base,
        top,
        base - decoupling,
        inversion,
        float(scene.cloudy.mean()),
    )


def _write_ir(path: Path, counts: np.ndarray, frame_t: np.ndarray, index: int, version: int) -> None:
    """The IRAI L1B file: big-endian counts, and epoch times (on some flights longer than the frames, with a
    stray zero or a fill value). From version 3 the counts say what they are (CF packing: kelvin = 0.01 x
    count + 180) and the file names its generator."""
    n_frames, rows, cols = counts.shape
    path.parent.mkdir(parents=True, exist_ok=True)
    time_utc = np.concatenate([frame_t, frame_t[-1] + 1.0 + np.arange(3 if index % 2 == 0 else 0)])
    time_utc[n_frames // 3] = 0.0 if index % 3 == 1 else time_utc[n_frames // 3]  # a stray zero
    time_utc[n_frames // 2] = -9999.0 if index % 3 == 2 else time_utc[n_frames // 2]  # a fill value
    with h5py.File(path, "w") as f:
        f.create_dataset("Product/Signal", data=counts, chunks=(1, rows, cols))
        if version >= 3:
            f["Product/Signal"].attrs.update(
                {"units": "K", "scale_factor": 1.0 / COUNTS_PER_K, "add_offset": COUNTS_ZERO_K}
            )
            f.attrs[GENERATOR_ATTR] = version
        else:
            f["Product/Signal"].attrs["units"] = "counts"
        f.create_dataset("Time/TimeUTC", data=time_utc)
        f["Time/TimeUTC"].attrs["units"] = "seconds since 1970-01-01 00:00:00 UTC"


def _write_cpl(path: Path, p: dict, date: dt.date, t0: float, north_east: np.ndarray) -> None:
    """The CPL L2 layer file: (N, 3) Julian days, (N, 10) layers (layer 0 on top), surfaces, angles,
    position."""
    n_frames = len(north_east)
    doy = (p["t"] - float(calendar.timegm(dt.date(date.year, 1, 1).timetuple()))) / 86400.0 + 1.0
    julian = np.stack([doy - p["half_day"], doy, doy + p["half_day"]], axis=1)  # (N, 3)
    lat = 34.0 + np.interp(p["t"] - t0, np.arange(n_frames), north_east[:, 0]) / 111.0
    lon = -122.0 + np.interp(p["t"] - t0, np.arange(n_frames), north_east[:, 1]) / 92.0
    with h5py.File(path, "w") as f:
        f.create_dataset("metadata_parameters/File_Year", data=np.array([str(date.year).encode()]))  # b'2025'
        g = f.create_group("layer_descriptor")
        g.create_dataset("Profile_Decimal_Julian_Day", data=julian)
        g.create_dataset("Layer_Base_Altitude", data=p["base"])
        g.create_dataset("Layer_Top_Altitude", data=p["top"])
        g.create_dataset("Number_Layers", data=p["n_layers"])
        g.create_dataset("Lidar_Surface_Altitude", data=p["surface"])
        g.create_dataset("DEM_Surface_Altitude", data=p["dem"])
        geo = f.create_group("geolocation")
        geo.create_dataset("Solar_Zenith_Angle", data=p["sza"].astype(np.float32))
        geo.create_dataset("Solar_Azimuth_Angle", data=p["saa"].astype(np.float32))
        geo.create_dataset("CPL_Latitude", data=np.stack([lat - 0.005, lat, lat + 0.005], axis=1))
        geo.create_dataset("CPL_Longitude", data=np.stack([lon - 0.005, lon, lon + 0.005], axis=1))


def _write_hdf_nav(path: Path, nav: dict, index: int, rng: np.random.Generator) -> None:
    """Navigation as the users' .hdf: no time axis (row i = frame i); longer than the frames, or on one flight
    shorter; about 1% of the zenith angles missing."""
    n_frames = len(nav["sza"])
    n_nav = n_frames - n_frames // 20 if index % 4 == 3 else n_frames + 25 + 10 * index
    idx = np.minimum(np.arange(n_nav), n_frames - 1)
    nav_sza = nav["sza"][idx].astype(np.float64)
    nav_sza[rng.random(n_nav) < 0.01] = np.nan
    with h5py.File(path, "w") as f:
        g = f.create_group("nav")
        g.create_dataset("solarZenith", data=nav_sza)
        g.create_dataset("sunAzGrd", data=nav["saa"][idx].astype(np.float64))
        g.create_dataset("trueHdg", data=nav["heading"][idx].astype(np.float64))
        g.create_dataset("IWG_lat", data=nav["lat"][idx])
        g.create_dataset("IWG_lon", data=nav["lon"][idx])


ICARTT_COLUMNS = (
    ("Latitude", "degN", "lat"),
    ("Longitude", "degE", "lon"),
    ("True_Heading", "degT", "heading"),
    ("Solar_Zenith_Angle", "deg", "sza"),
    ("Sun_Azimuth", "deg (+-180)", "saa"),  # -180..180, as the real MetNav files write it
)
ICARTT_FLAGS = {"ULOD_FLAG": "-7777", "ULOD_VALUE": "N/A", "LLOD_FLAG": "-8888", "LLOD_VALUE": "N/A"}
ICARTT_KEYWORDS = (
    "PI_CONTACT_INFO",
    "PLATFORM",
    "LOCATION",
    "ASSOCIATED_DATA",
    "INSTRUMENT_INFO",
    "DATA_INFO",
    "UNCERTAINTY",
    "ULOD_FLAG",
    "ULOD_VALUE",
    "LLOD_FLAG",
    "LLOD_VALUE",
    "DM_CONTACT_INFO",
    "PROJECT_INFO",
    "STIPULATIONS_ON_USE",
    "OTHER_COMMENTS",
    "REVISION",
    "R0",
)


def write_icartt_nav(
    path: Path,
    date: dt.date,
    seconds_of_day: np.ndarray,
    per_frame: dict,
    rng: np.random.Generator,
    fill: float = -9999.0,
) -> None:
    """ER-2 navigation as public ICARTT 1001 text (`*_MetNav_ER2_YYYYMMDD_R0.ict`): one record per whole
    second from 10 s before the first frame to 10 s after the last, Time_Start in seconds since 00 UTC of
    `date` (going past 86400 after midnight), a Day_Of_Year column (the record's UTC day) and the sun azimuth
    in -180..180 as in the real files, the values of the nearest frame, about 1% fill values."""
    frame_s = np.asarray(seconds_of_day, np.float64)
    ok = np.isfinite(frame_s) & (frame_s > -86400) & (frame_s < 2 * 86400)
    t = np.arange(np.floor(frame_s[ok].min()) - 10, np.ceil(frame_s[ok].max()) + 11)
    nearest = np.flatnonzero(ok)[np.abs(frame_s[ok][None, :] - t[:, None]).argmin(axis=1)]
    values = np.stack([per_frame[key][nearest] for _, _, key in ICARTT_COLUMNS], 1)
    values[rng.random(values.shape) < 0.01] = fill
    values[:, 2] = per_frame["heading"][nearest]  # heading always present
    saa = values[:, 4]
    values[:, 4] = np.where(saa == fill, fill, (saa + 180.0) % 360.0 - 180.0)
    day = date.timetuple().tm_yday + np.floor(t / 86400.0)  # the record's UTC day
    values = np.concatenate([day[:, None], values], 1)
    names = ["Time_Start", "Day_Of_Year"] + [n for n, _, _ in ICARTT_COLUMNS]
    comments = [f"{k}: {ICARTT_FLAGS.get(k, 'demo')}" for k in ICARTT_KEYWORDS[:-1]]
    comments += ["R0: synthetic CloudML demo", ", ".join(names)]
    header = [
        "1001",
        "CloudML demo",
        "CloudML",
        "ER-2 meteorological and navigation data (synthetic)",
        "DEMO",
        "1, 1",
        f"{date:%Y, %m, %d}, {date:%Y, %m, %d}",
        "1.0",
        "Time_Start, seconds, Time_Start",
        str(len(ICARTT_COLUMNS) + 1),
        ", ".join(["1"] * (len(ICARTT_COLUMNS) + 1)),
        ", ".join([f"{fill:g}"] * (len(ICARTT_COLUMNS) + 1)),
        "Day_Of_Year, day of year beginning Jan 1, Day_Of_Year",
        *[f"{n}, {u}, {n}" for n, u, _ in ICARTT_COLUMNS],
        "0",
        str(len(comments)),
        *comments,
    ]
    header[0] = f"{len(header)}, 1001"
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w") as f:
        f.write("\n".join(header) + "\n")
        for ti, row in zip(t, values):
            f.write(f"{ti:.0f}, " + ", ".join(f"{v:.6g}" for v in row) + "\n")


def written_version(folder: Path) -> str | None:
    """The generator version the demo version file beside a folder's demo flights names (read without
    following a link or blocking on a FIFO); None where there is none, or it names no version."""
    from cloudml_lib.base.files import read_text

    try:
        version = read_text(Path(folder) / VERSION_FILE, limit=64, follow=False).strip()
    except (OSError, CloudMLError):
        return None
    return version if version.isdigit() else None


def adopt_demo(folder: Path) -> str | None:
    """Demo flights of an earlier CloudML, proved by two files, never by one (a copied version file proved a
    user's folder CloudML's): the demo version file it wrote, and a flight's IR file of the demo's layout
    (its name, and its frames where the demo writes them)."""
    version = written_version(folder)
    if version is None:
        return None
    for ir in sorted(Path(folder).glob("*/GLOVE2025_IRAI_L1B_Rev-_*.h5"))[:10]:
        if holds_dataset(ir, "Product/Signal"):
            return f"its {VERSION_FILE} says demo version {version} beside flight {ir.parent.name}"
    return None


DEMO = Kind("demo flights", "--out", adopt_demo, "the folder of earlier demo flights to write them again")


def make_demo_flights(
    out_dir: str | Path,
    n_flights: int = 5,
    seed: int = 0,
    frames_per_flight: int = DEMO_FRAMES,
    frame_shape: tuple[int, int] = DEMO_FRAME_SHAPE,
    dates: list[dt.date] | None = None,
    option: str = "--out",
    version: int = DEMO_VERSION,
) -> list[dict]:
    """Write `n_flights` demo flights into `out_dir` (on `dates`, default from 1 March 2025 every
    other day); returns their `data.flights` entries. `option`: what names the folder in a refusal;
    `version`: the generator's (DEMO_VERSIONS; an earlier one writes the flights the runs made on it saw)."""
    if n_flights < 2:
        raise ValueError(f"--flights must be at least 2 (one to train on, one to hold out), got {n_flights}")
    if version not in DEMO_VERSIONS:
        raise ValueError(
            f"--generator {version}: this CloudML writes demo flights of generator version "
            f"{', '.join(map(str, DEMO_VERSIONS[:-1]))} or {DEMO_VERSIONS[-1]}"
        )
    rows, cols = frame_shape
    out = claim(
        out_dir, replace(DEMO, option=option)
    )  # made (or adopted) and marked before a flight is written
    entries = demo_flight_entries(n_flights, dates)
    names = demo_flight_names(n_flights, dates)
    folders = [(out / e["ir_file"]).parent for e in entries]
    spans = [era5_span(date, i, frames_per_flight) for i, (_, date) in enumerate(names)]
    files = [out / e[key] for e in entries for key in ("ir_file", "cpl_file", "nav_file")] + [
        out / VERSION_FILE
    ]
    if version >= 4:  # found by name in the flight's folder (era5.find_files): no entry names them
        files += [
            f / n for f, (name, _), s in zip(folders, names, spans) for n in demo_era5.file_names(name, s)
        ]
    for path in files:  # a file of the user's where a flight's file goes is named, before anything is written
        ledger.refuse_unless_mine(path, "replace")
    for path in files:
        ledger.add(path)
    for i in tqdm(range(n_flights), desc="demo flights", unit="flight"):
        rng = np.random.default_rng([seed, i])
        scene, track = _write_flight(
            out, entries[i], names[i][1], i, rng, frames_per_flight, (rows, cols), version
        )
        if version >= 4:  # a stream of its own: the draws of the frames, labels and nav stay version 3's
            layer, layout = boundary_layer(i, scene), demo_era5.layout_of(i)
            era5_rng = np.random.default_rng([seed, i, 4])
            demo_era5.write_flight(folders[i], names[i][0], layer, track, spans[i], layout, era5_rng)
    (out / VERSION_FILE).write_text(f"{version}\n")
    log.info(
        "wrote %d demo flights (generator version %d, %d frames of %dx%d each) to %s",
        n_flights,
        version,
        frames_per_flight,
        rows,
        cols,
        out,
    )
    return entries


def ensure_demo_flights(data: DataConfig, frames: int = DEMO_FRAMES) -> DataConfig:
    """With `data.demo`, write the demo flights into data.dir when it holds no flight files (they are
    then found there like real flights), of `frames` frames each (the notebooks' headless test writes
    shorter ones); returns `data` testing on the demo's test flight when it names none
    (`data` itself is not changed). Called only where a command starts (commands/, colab/: import-linter's
    contract), never from a layer that reads flights: those find the demo flights like real ones."""
    if not data.demo:
        return data
    data = replace(data, test_flights=demo_test_flights(data.demo, data.test_flights))
    version = written_version(Path(data.dir))
    if version is not None and version != str(DEMO_VERSION):
        # the runs made on them continue on them: an earlier generator's flights are never written over
        log.warning(
            "data.demo: the demo flights in %s were written by an earlier CloudML (generator version %s; "
            "this one writes %d): they are kept and used as they are, so that a run trained on them goes on "
            "with them. The demo of this version goes into a folder of its own (configs/demo.yaml: "
            ".cloudml_demo/flights_v%d; or make-demo-data --out NEW_FOLDER).",
            data.dir,
            version,
            DEMO_VERSION,
            DEMO_VERSION,
        )
        return data
    if not data.flights and not (Path(data.dir).is_dir() and flights.find_flights(data)):
        log.info("data.demo: generating %d demo flights into %s", DEMO_FLIGHTS, data.dir)
        make_demo_flights(
            data.dir, n_flights=DEMO_FLIGHTS, seed=DEMO_SEED, frames_per_flight=frames, option="data.dir"
        )
    return data
