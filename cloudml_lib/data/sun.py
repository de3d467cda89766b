"""Where the sun is, from time and position, and whether a nav file's sun angles agree with it.

The sun's position follows NOAA's solar calculator (the Meeus-based equations of NOAA's Global Monitoring
Laboratory spreadsheet: Julian century, the sun's apparent longitude, the obliquity, the equation of time,
the hour angle), the geometric position without refraction. On the real IMPACTS MetNav file of 2023-03-02
every daylight record agrees with it within 0.3 degrees, zenith and azimuth (tests/test_sun.py).

`compare` judges a whole flight: where the computed sun is up, the median difference and the share of records
beyond TOLERANCE_DEG, for the zenith and for the azimuth (clockwise from north; 0..360 and -180..180 agree).
One record at sunrise can look alike under a swap; a flight cannot. The check only warns: nothing read is
changed because of it, and it is no part of any cache key.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

TOLERANCE_DEG = 2.0  # the real file: 0.3 at most; a swap or a wrong column: tens of degrees
MAX_SHARE_OFF = 0.05  # a flight whose daylight records are more often off than this is warned about
MIN_RECORDS = 10  # fewer daylight records than this: not judged
AZIMUTH_FROM_ZENITH_DEG = 5.0  # the azimuth is not judged with the sun this close to overhead


def position(epoch_s: np.ndarray, lat_deg: np.ndarray, lon_deg: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The sun's zenith angle and azimuth (degrees, clockwise from north, 0..360) at Unix epoch seconds and
    positions (degrees north and east); NaN where an input is NaN."""
    t = np.asarray(epoch_s, np.float64)
    century = (t / 86400.0 + 2440587.5 - 2451545.0) / 36525.0
    mean_long = np.mod(280.46646 + century * (36000.76983 + century * 0.0003032), 360.0)
    anomaly = np.radians(357.52911 + century * (35999.05029 - 0.0001537 * century))
    eccentricity = 0.016708634 - century * (0.000042037 + 0.0000001267 * century)
    centre = (
        np.sin(anomaly) * (1.914602 - century * (0.004817 + 0.000014 * century))
        + np.sin(2 * anomaly) * (0.019993 - 0.000101 * century)
        + np.sin(3 * anomaly) * 0.000289
    )
    omega = np.radians(125.04 - 1934.136 * century)
    apparent_long = np.radians(mean_long + centre - 0.00569 - 0.00478 * np.sin(omega))
    seconds = 21.448 - century * (46.815 + century * (0.00059 - century * 0.001813))
    obliquity = np.radians(23.0 + (26.0 + seconds / 60.0) / 60.0 + 0.00256 * np.cos(omega))
    declination = np.arcsin(np.sin(obliquity) * np.sin(apparent_long))
    y = np.tan(obliquity / 2) ** 2
    l0 = np.radians(mean_long)
    equation_of_time_min = 4.0 * np.degrees(
        y * np.sin(2 * l0)
        - 2 * eccentricity * np.sin(anomaly)
        + 4 * eccentricity * y * np.sin(anomaly) * np.cos(2 * l0)
        - 0.5 * y * y * np.sin(4 * l0)
        - 1.25 * eccentricity**2 * np.sin(2 * anomaly)
    )
    true_solar_min = np.mod(
        np.mod(t, 86400.0) / 60.0 + equation_of_time_min + 4.0 * np.asarray(lon_deg), 1440
    )
    hour_angle = np.radians(true_solar_min / 4.0 - 180.0)
    lat = np.radians(np.asarray(lat_deg, np.float64))
    cos_zenith = np.sin(lat) * np.sin(declination) + np.cos(lat) * np.cos(declination) * np.cos(hour_angle)
    zenith = np.degrees(np.arccos(np.clip(cos_zenith, -1.0, 1.0)))
    from_south = np.arctan2(
        np.sin(hour_angle), np.cos(hour_angle) * np.sin(lat) - np.tan(declination) * np.cos(lat)
    )
    return zenith, np.mod(np.degrees(from_south) + 180.0, 360.0)


def _angle_off(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """|a - b| on the circle, degrees (0..180)."""
    return np.abs(np.mod(a - b + 180.0, 360.0) - 180.0)


@dataclass(frozen=True)
class Agreement:
    """How a flight's sun angles agree with the computed sun, where it is up."""

    records: int  # daylight records with both angles
    zenith_median: float  # degrees
    zenith_share_off: float  # share of `records` beyond TOLERANCE_DEG
    azimuth_median: float
    azimuth_share_off: float
    swapped: bool  # the columns agree with the sun once zenith and azimuth are exchanged

    @property
    def judged(self) -> bool:
        return self.records >= MIN_RECORDS

    @property
    def agrees(self) -> bool:
        return not self.judged or max(self.zenith_share_off, self.azimuth_share_off) <= MAX_SHARE_OFF

    def words(self) -> str:
        return (
            f"zenith off by {self.zenith_median:.1f} deg (median; {self.zenith_share_off:.0%} of "
            f"{self.records:,} daylight records beyond {TOLERANCE_DEG:g} deg), azimuth off by "
            f"{self.azimuth_median:.1f} deg ({self.azimuth_share_off:.0%} beyond)"
        )


def _shares(zenith, azimuth, sun_zenith, sun_azimuth) -> tuple[float, float, float, float]:
    dz, da = np.abs(zenith - sun_zenith), _angle_off(azimuth, sun_azimuth)
    da = da[sun_zenith > AZIMUTH_FROM_ZENITH_DEG]
    median = lambda x: float(np.median(x)) if x.size else 0.0
    share = lambda x: float(np.mean(x > TOLERANCE_DEG)) if x.size else 0.0
    return median(dz), share(dz), median(da), share(da)


def compare(
    epoch_s: np.ndarray, lat_deg: np.ndarray, lon_deg: np.ndarray, zenith: np.ndarray, azimuth: np.ndarray
) -> Agreement:
    """The flight's zenith and azimuth columns (degrees; NaN where not usable) against the sun computed at
    each record's time and position, over the records where the computed sun is up."""
    sun_zenith, sun_azimuth = position(epoch_s, lat_deg, lon_deg)
    zenith, azimuth = np.asarray(zenith, np.float64), np.asarray(azimuth, np.float64)
    with np.errstate(invalid="ignore"):
        day = np.isfinite(sun_zenith) & (sun_zenith < 90.0) & np.isfinite(zenith) & np.isfinite(azimuth)
    if not day.any():
        return Agreement(0, 0.0, 0.0, 0.0, 0.0, False)
    sz, sa, z, a = sun_zenith[day], sun_azimuth[day], zenith[day], azimuth[day]
    as_read = _shares(z, a, sz, sa)
    exchanged = _shares(a, z, sz, sa)
    swapped = max(exchanged[1], exchanged[3]) <= MAX_SHARE_OFF < max(as_read[1], as_read[3])
    return Agreement(int(day.sum()), *as_read, swapped)
