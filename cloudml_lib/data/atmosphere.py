"""Predictors a boundary-layer meteorologist derives from the reanalysis, each with its unit and source.

Marine low cloud forms where air lifted from the surface saturates: near the lifting condensation level
where the boundary layer is well mixed (coupled), above it where the layer is decoupled, under an inversion
whose strength the lower troposphere's stability measures. Every function takes and returns numpy arrays
(NaN in, NaN out) in SI units unless its name says otherwise.

Constants and formulas:
- Saturation vapour pressure over liquid water and the lifting condensation level: Romps (2017), "Exact
  expression for the lifting condensation level", J. Atmos. Sci. 74, 3891-3900 (his constants below; the
  LCL's temperature through the lower branch of the Lambert W function, scipy.special.lambertw).
- Espy's rule (125 m per kelvin of dew-point depression): the approximation Romps compares with, kept as a
  cross-check.
- Lower-tropospheric stability LTS = theta(700 hPa) - theta(surface): Klein and Hartmann (1993), J. Climate
  6, 1587-1606.
- Estimated inversion strength EIS = LTS - Gamma_m(850 hPa) (z700 - LCL): Wood and Bretherton (2006),
  J. Climate 19, 6425-6432, with the moist-adiabatic lapse rate at 850 hPa and the mean of the surface and
  700 hPa temperatures (their eq. 5), z700 the height of the 700 hPa surface."""

from __future__ import annotations

import numpy as np

# Romps (2017): the triple point, the vapour's energy at it, gas constants and heat capacities
T_TRIP = 273.16  # K
P_TRIP = 611.65  # Pa
E0V = 2.3740e6  # J kg-1, the difference in specific internal energy between vapour and liquid at T_TRIP
GRAVITY = 9.81  # m s-2
R_AIR = 287.04  # J kg-1 K-1
R_VAP = 461.0  # J kg-1 K-1
CV_AIR = 719.0  # J kg-1 K-1
CV_VAP = 1418.0  # J kg-1 K-1
CV_LIQ = 4119.0  # J kg-1 K-1
CP_AIR = CV_AIR + R_AIR
CP_VAP = CV_VAP + R_VAP
ESPY_M_PER_K = 125.0  # Espy's rule: LCL height per kelvin of dew-point depression
P0 = 100000.0  # Pa, the reference pressure of potential temperature
KAPPA = R_AIR / CP_AIR
LV = 2.501e6  # J kg-1, latent heat of vaporisation at 0 C (for the moist-adiabatic lapse rate)


def saturation_vapour_pressure(t: np.ndarray) -> np.ndarray:
    """Pa over liquid water at temperature `t` (K); Romps (2017), eq. 4 (Rankine-Kirchhoff, constant heat
    capacities)."""
    t = np.asarray(t, dtype=np.float64)
    return (
        P_TRIP
        * (t / T_TRIP) ** ((CP_VAP - CV_LIQ) / R_VAP)
        * np.exp((E0V - (CV_VAP - CV_LIQ) * T_TRIP) / R_VAP * (1.0 / T_TRIP - 1.0 / t))
    )


def relative_humidity(t: np.ndarray, dew_point: np.ndarray) -> np.ndarray:
    """Relative humidity over liquid water (0-1) of air at `t` (K) with `dew_point` (K): the vapour
    pressure at saturation at the dew point over that at the temperature (Romps's saturation curve)."""
    return saturation_vapour_pressure(dew_point) / saturation_vapour_pressure(t)


def specific_humidity(pressure: np.ndarray, vapour_pressure: np.ndarray) -> np.ndarray:
    """kg kg-1 of vapour in moist air at `pressure` (Pa) with `vapour_pressure` (Pa)."""
    p, e = np.asarray(pressure, dtype=np.float64), np.asarray(vapour_pressure, dtype=np.float64)
    return R_AIR * e / (R_VAP * p + e * (R_AIR - R_VAP))


def lcl_height(pressure: np.ndarray, t: np.ndarray, dew_point: np.ndarray) -> np.ndarray:
    """Height (m above the surface) of the lifting condensation level of surface air at `pressure` (Pa), `t`
    (K) and `dew_point` (K): Romps (2017), eqs. 22a-22d, over liquid water. At saturation it is 0."""
    from scipy.special import lambertw

    p, t = np.asarray(pressure, dtype=np.float64), np.asarray(t, dtype=np.float64)
    rh = np.clip(relative_humidity(t, dew_point), 0.0, 1.0)
    qv = specific_humidity(p, rh * saturation_vapour_pressure(t))
    cpm = (1.0 - qv) * CP_AIR + qv * CP_VAP
    rm = (1.0 - qv) * R_AIR + qv * R_VAP
    a = cpm / rm + (CV_LIQ - CP_VAP) / R_VAP
    b = -(E0V - (CV_VAP - CV_LIQ) * T_TRIP) / (R_VAP * t)
    c = b / a
    with np.errstate(divide="ignore", invalid="ignore"):
        w = lambertw(rh ** (1.0 / a) * c * np.exp(c), k=-1).real
        t_lcl = c / w * t
    return np.where(np.isfinite(t_lcl), cpm * (t - t_lcl) / GRAVITY, np.nan)


def lcl_height_espy(t: np.ndarray, dew_point: np.ndarray) -> np.ndarray:
    """Espy's approximation of the LCL height (m): 125 m per kelvin of dew-point depression."""
    return ESPY_M_PER_K * (np.asarray(t, dtype=np.float64) - np.asarray(dew_point, dtype=np.float64))


def sea_air_difference(sea: np.ndarray, air: np.ndarray) -> np.ndarray:
    """K: the sea's surface temperature less the 2 m air temperature (positive: the sea warms the air, the
    surface layer is unstable, as under most marine stratocumulus)."""
    return np.asarray(sea, dtype=np.float64) - np.asarray(air, dtype=np.float64)


def potential_temperature(t: np.ndarray, pressure: np.ndarray) -> np.ndarray:
    """K: the temperature of air at `t` (K) and `pressure` (Pa) brought dry-adiabatically to 1000 hPa."""
    return np.asarray(t, dtype=np.float64) * (P0 / np.asarray(pressure, dtype=np.float64)) ** KAPPA


def lower_tropospheric_stability(
    t700: np.ndarray, t_surface: np.ndarray, p_surface: np.ndarray
) -> np.ndarray:
    """K: theta at 700 hPa less theta of the surface air (Klein and Hartmann 1993)."""
    return potential_temperature(t700, 70000.0) - potential_temperature(t_surface, p_surface)


def moist_adiabatic_lapse_rate(t: np.ndarray, pressure: np.ndarray) -> np.ndarray:
    """K m-1: the saturated-adiabatic lapse rate at `t` (K) and `pressure` (Pa), as Wood and Bretherton
    (2006, eq. 5) write it: (g / cp) [1 - (1 + Lv qs / (Ra T)) / (1 + Lv^2 qs / (cp Rv T^2))]."""
    t = np.asarray(t, dtype=np.float64)
    qs = specific_humidity(pressure, saturation_vapour_pressure(t))
    return (GRAVITY / CP_AIR) * (
        1.0 - (1.0 + LV * qs / (R_AIR * t)) / (1.0 + LV**2 * qs / (CP_AIR * R_VAP * t**2))
    )


def estimated_inversion_strength(
    t700: np.ndarray,
    z700: np.ndarray,
    t_surface: np.ndarray,
    p_surface: np.ndarray,
    lcl: np.ndarray,
) -> np.ndarray:
    """K: LTS less the moist-adiabatic lapse rate at 850 hPa (at the mean of the surface and 700 hPa
    temperatures) times the depth from the LCL (m) to the 700 hPa surface (z700, m): Wood and Bretherton
    (2006)."""
    gamma = moist_adiabatic_lapse_rate(
        (np.asarray(t700, dtype=np.float64) + np.asarray(t_surface, dtype=np.float64)) / 2.0, 85000.0
    )
    return lower_tropospheric_stability(t700, t_surface, p_surface) - gamma * (
        np.asarray(z700, dtype=np.float64) - np.asarray(lcl, dtype=np.float64)
    )


def geopotential_height(z: np.ndarray) -> np.ndarray:
    """m: ERA5's geopotential (m2 s-2) over standard gravity (9.80665, ECMWF's)."""
    return np.asarray(z, dtype=np.float64) / 9.80665


def wind_speed(u: np.ndarray, v: np.ndarray) -> np.ndarray:
    """m s-1 from the eastward and northward components."""
    return np.hypot(np.asarray(u, dtype=np.float64), np.asarray(v, dtype=np.float64))
