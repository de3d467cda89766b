"""The demo flights as a run sees them: how many there are, their names, which one is the test flight. The
generator that writes them is synthetic.py, reached only where a command starts (import-linter); a run finds
the demo flights in data.dir like real ones, and this is all it needs to know of them."""

from __future__ import annotations

import datetime as dt

DEMO_FLIGHTS = 5  # how many make_demo_flights writes by default
DEMO_TEST_INDEX = 2  # the demo's test flight (05Mar25): inside the training flights' range


def demo_flight_names(n_flights: int, dates: list[dt.date] | None = None) -> list[tuple[str, dt.date]]:
    """(name, date) of each demo flight: one every two days from 1 March 2025, named as real flights are."""
    dates = dates or [dt.date(2025, 3, 1) + dt.timedelta(days=2 * i) for i in range(n_flights)]
    return [(d.strftime("%d%b%y"), d) for d in dates[:n_flights]]


def demo_test_flights(demo: bool, test_flights: list[str]) -> list[str]:
    """The test flights of a demo config that names none: the demo's own."""
    if not demo or test_flights:
        return list(test_flights)
    return [demo_flight_names(DEMO_FLIGHTS)[DEMO_TEST_INDEX][0]]
