"""What the two Colab notebooks call, one function per cell.

- drive.py      the CloudML folder on Drive, the data check, the preprocessing cache, diagnostics
- picker.py     the preset picker, which comes back with the run the user started;  expected.py  how long
                the run as chosen will take, timed once per choice
- live.py       a command as a subprocess with a live view (bar, curves, notices, folded log)
- training.py   train, cross-validate, predict whole flights, adapt to a flight, export the model, and the
                smoke test's checks
- sweeping.py   the optional sweep (Optuna, installed when asked for), trial by trial, and its report
- show.py       Markdown, user errors without a traceback, presets, status, evaluation, report
- install.py    the notebooks' first cell: install from the Drive copy when it changed (standard library
                only, run by its path before anything is installed); modules.py  every module of the
                package, which it checks the copy against

How the flow runs, for a user or for the headless test (CLOUDML_SMOKE=1: the demo flights, a tiny run, a
simulated disconnect, the checks of the last cells), is one profile (profile.py), chosen where the flow
starts; smoke.py holds the test's own steps.

The top layer: may import commands, science, train, core, data, base.
"""

from cloudml_lib.colab.drive import (
    RunFlights,
    Workspace,
    build_cache,
    check_setup,
    fetch_era5,
    free_gpu_memory,
    run_config,
    run_flights,
    show_diagnostics,
    show_environment,
    uses_demo_data,
    verify_data,
    version,
    workspace,
)
from cloudml_lib.colab.picker import Choice, Picker, newest_run, preset_picker
from cloudml_lib.colab.profile import smoke
from cloudml_lib.colab.show import (
    UserError,
    show_comparison,
    show_evaluation,
    show_presets,
    show_report,
    show_status,
    show_tensorboard,
)
from cloudml_lib.colab.sweeping import sweep
from cloudml_lib.colab.training import adapt, check_smoke_run, crossval, export, train, whole_flights

__all__ = [
    "Choice",
    "Picker",
    "RunFlights",
    "UserError",
    "Workspace",
    "build_cache",
    "check_setup",
    "check_smoke_run",
    "crossval",
    "adapt",
    "export",
    "fetch_era5",
    "free_gpu_memory",
    "newest_run",
    "preset_picker",
    "run_config",
    "run_flights",
    "show_comparison",
    "show_diagnostics",
    "show_environment",
    "show_evaluation",
    "show_presets",
    "show_report",
    "show_status",
    "show_tensorboard",
    "smoke",
    "sweep",
    "train",
    "uses_demo_data",
    "verify_data",
    "version",
    "whole_flights",
    "workspace",
]
