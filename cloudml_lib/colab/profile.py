"""How the notebooks' flow runs, chosen once where it starts (`workspace()`, the first cell of each notebook):
for a user, or for the headless test of the notebooks.

- the user's profile: the CloudML folder on Drive in Colab (./CloudML or CLOUDML_HOME elsewhere), the user's
  flights (the demo flights until there are some), the picker's choices; nothing else happens.
- the smoke profile (CLOUDML_SMOKE=1, `pytest --nbmake colab_setup.ipynb colab_training.ipynb`): a workspace
  in `.cloudml_smoke/`, always the demo flights (half their length: smoke.DEMO_FRAMES) with the cache on a
  "VM disk" and a copy in the workspace (as in Colab), a tiny run of smoke.EPOCHS epochs named "smoke",
  killed mid-epoch as by a disconnect before the Train cell continues it, and the checks of the last cells
  (smoke.py, imported by this profile only).

The cells ask the profile what to do; none of them tests for the smoke test itself.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class Profile:
    smoke: bool = False

    @property
    def root(self) -> Path | None:
        """The workspace's folder; None: the user's (Drive in Colab, else CLOUDML_HOME or ./CloudML)."""
        return Path(".cloudml_smoke").resolve() if self.smoke else None

    @property
    def demo_only(self) -> bool:
        """The demo flights whatever data/ holds."""
        return self.smoke

    @property
    def demo_frames(self) -> int:
        """Frames per demo flight where this profile writes them: the demo's own length, or the smoke's."""
        from cloudml_lib.data.synthetic import DEMO_FRAMES

        return self._smoke().DEMO_FRAMES if self.smoke else DEMO_FRAMES

    @property
    def cache_copy(self) -> bool:
        """The cache on the VM's disk with a lasting copy in the workspace, as in Colab (exercised here)."""
        return self.smoke

    @property
    def overrides(self) -> list[str]:
        """Settings every run of this profile adds to its config."""
        return list(self._smoke().OVERRIDES) if self.smoke else []

    def epochs(self, chosen: int | None) -> int | None:
        """The epochs a run trains: the user's choice, or the smoke run's own."""
        return self._smoke().EPOCHS if self.smoke else chosen

    def run_name(self, chosen: str) -> str:
        return "smoke" if self.smoke else chosen

    def picker_note(self) -> str | None:
        """A line of the picker's note, in the smoke test only."""
        if not self.smoke:
            return None
        return f"a tiny demo run of {self._smoke().EPOCHS} epochs trains, whatever is chosen."

    def after_setup(self, cache: dict | None) -> bool:
        """The end of the setup notebook: the smoke test's checks (True), or nothing (False: what is next is
        said)."""
        if self.smoke:
            self._smoke().check_cache(cache)
        return self.smoke

    def before_training(self, run_dir: Path, command: list[str]) -> bool:
        """Before the Train cell trains: the smoke test starts a fresh run and kills it mid-epoch, as a
        disconnect would (True: the run is to be continued, not kept as it is)."""
        if self.smoke:
            self._smoke().simulate_disconnect(run_dir, command)
        return self.smoke

    def after_run(self, run_dir: Path | None) -> None:
        """The training notebook's last cell: the smoke test's checks of the run; nothing in normal use."""
        if self.smoke:
            self._smoke().check_run(run_dir)

    @staticmethod
    def _smoke():
        import importlib

        return importlib.import_module("cloudml_lib.colab.smoke")  # (colab.smoke is the function below)


_chosen: Profile | None = None


def choose() -> Profile:
    """The profile of this flow, from CLOUDML_SMOKE, chosen anew where the flow starts."""
    global _chosen
    _chosen = Profile(smoke=os.environ.get("CLOUDML_SMOKE") == "1")
    return _chosen


def profile() -> Profile:
    """The profile chosen where this flow started (chosen now if it has not started)."""
    return _chosen if _chosen is not None else choose()


def smoke() -> bool:
    """Whether this flow is the headless test (the notebooks' first cell says so beside the version)."""
    return profile().smoke
