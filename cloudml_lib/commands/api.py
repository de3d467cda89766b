"""The Python API for a scientist's own notebook: load a run, train or resume one, evaluate it, predict a
flight into an xarray Dataset, read its report as data, export it. Importable from the package top
(``import cloudml_lib as cml; cml.load_run(...)``); these names are the stated API, kept from release to
release, and everything else in the package is internal.

Example
-------
>>> import cloudml_lib as cml
>>> run = cml.fit("configs/demo.yaml", "runs/demo")        # doctest: +SKIP
>>> run.report()["overall"]["r2"]                            # doctest: +SKIP
>>> ds = run.predict("01Mar25")                              # doctest: +SKIP
>>> ds.cloud_base_height.plot()                              # doctest: +SKIP
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from cloudml_lib.base.config import Config, build_config, load_config
from cloudml_lib.base.errors import ArgumentTypeError, ArgumentValueError, CloudMLError, shown
from cloudml_lib.core.run.folder import RunFolder

__all__ = ["Run", "load_run", "fit", "evaluate", "predict_flight", "adapt", "read_report", "export"]


@dataclass(frozen=True)
class Run:
    """A run folder: what a training command wrote (``best.pt``, checkpoints, metrics, evaluation).

    Parameters
    ----------
    path : pathlib.Path
        The run's folder (``--run-dir`` of the command line).
    """

    path: Path

    @property
    def state(self) -> str:
        """Where the run stands, in words: "stopped (resumable)", "trained, end pending (why)",
        "finished", "failed (why)", "running" or "not a run"."""
        return RunFolder(self.path).state().words

    def history(self) -> list[dict]:
        """One dict per epoch trained (``metrics.jsonl``): epoch, step, train_loss and val_loss (scaled
        heights, squared), r2, mae_km, rmse_km and bias_km (km) on the validation data, lr, time_s (s)."""
        return [r for r in RunFolder(self.path).files.metrics() if r.get("kind") == "epoch"]

    def report(self) -> dict:
        """See :func:`read_report`."""
        return read_report(self)

    def evaluate(self, data_dir: str | Path | None = None) -> dict:
        """See :func:`evaluate`."""
        return evaluate(self, data_dir=data_dir)

    def predict(self, flight: str | None = None, **options):
        """See :func:`predict_flight`."""
        return predict_flight(self, flight, **options)

    def adapt(self, flight: str | None = None, **options) -> dict:
        """See :func:`adapt`."""
        return adapt(self, flight, **options)

    def export(self, out: str | Path | None = None) -> Path:
        """See :func:`export`."""
        return export(self, out)


def _place(name: str, value) -> Path:
    """A path argument checked before anything is read or written: a str or os.PathLike, not empty."""
    if isinstance(value, (str, os.PathLike)) and not isinstance(value, bytes) and str(value).strip():
        return Path(value)
    raise ArgumentTypeError(f"{name}={shown(value)}: expected a folder's path, a str or pathlib.Path")


def _maybe_place(name: str, value) -> Path | None:
    """An optional path argument: None, or as `_place` checks it."""
    if value is None:
        return None
    try:
        return _place(name, value)
    except ArgumentTypeError:
        raise ArgumentTypeError(
            f"{name}={shown(value)}: expected a folder's path, a str or pathlib.Path, or None"
        ) from None


def _folder(run, name: str = "run") -> RunFolder:
    """A run argument: a Run (load_run, fit) or its folder's path, as the RunFolder the library takes."""
    return RunFolder(run.path if isinstance(run, Run) else _place(name, run))


def _flight(flight) -> str | None:
    if flight is None or (isinstance(flight, str) and flight.strip()):
        return flight
    raise ArgumentTypeError(f"flight={shown(flight)}: expected a flight's name such as '05Mar25', or None")


def _config(config) -> Config:
    """fit's config: a Config validated again (one changed after it was loaded is checked as a file is), or
    a YAML file's path."""
    if isinstance(config, Config):
        return build_config(config.to_dict(), source="the Config given as config=")
    return load_config(_place("config", config))


def load_run(path: str | Path) -> Run:
    """A run written by ``train`` (here, on the command line or in the notebooks).

    Parameters
    ----------
    path : str or pathlib.Path
        The run's folder.

    Returns
    -------
    Run

    Raises
    ------
    cloudml_lib.CloudMLError
        Where the folder holds no run (its message names the folder and what it holds).
    """
    folder = RunFolder.of(_place("path", path))
    if not folder.path.is_dir():
        raise CloudMLError(f"path={shown(str(folder.path))}: no such folder (a run's folder: fit's run_dir=)")
    if not folder.holds_run():
        raise CloudMLError(
            f"path={shown(str(folder.path))} holds no run (no best.pt, checkpoints, metrics or config.yaml): "
            "give the folder that fit (or train) wrote"
        )
    return Run(folder.path)


def fit(config: Config | str | Path, run_dir: str | Path, resume: str = "auto") -> Run:
    """Train a run to its end (evaluation, intervals, report), or resume it where it stopped.

    Parameters
    ----------
    config : Config, str or pathlib.Path
        A config (:func:`cloudml_lib.load_config`) or the path of a YAML file.
    run_dir : str or pathlib.Path
        The run's folder: new, or the folder of a stopped run with the same config (it resumes).
    resume : str
        As ``train --resume``: "auto" continues from the newest valid checkpoint in ``run_dir`` (a new run
        where there is none), "never" refuses to touch an existing run, a path continues from that
        checkpoint.

    Returns
    -------
    Run
        The finished run: ``run.report()`` holds its test-flight skill.
    """
    from cloudml_lib.commands.runs import train_run

    cfg, folder = _config(config), _place("run_dir", run_dir)
    if not isinstance(resume, (str, os.PathLike)) or isinstance(resume, str) and not resume.strip():
        raise ArgumentTypeError(
            f"resume={shown(resume)}: expected 'auto', 'never' or a checkpoint's path (a str or pathlib.Path)"
        )
    train_run(cfg, folder, os.fspath(resume))
    return Run(folder)


def evaluate(
    run: Run | str | Path, data_dir: str | Path | None = None, cache_dir: str | Path | None = None
) -> dict:
    """Score a finished run's best model on its test flights again, and rewrite its evaluation files.

    Parameters
    ----------
    run : Run, str or pathlib.Path
    data_dir : str or pathlib.Path, optional
        Where the flight files are now, if not where the run recorded them.
    cache_dir : str or pathlib.Path, optional
        Where the preprocessing cache goes, if the run's recorded one is not on this machine.

    Returns
    -------
    dict
        The report, as :func:`read_report` returns it.
    """
    from cloudml_lib.science.evaluate import evaluate_run

    folder, data, cache = (
        _folder(run),
        _maybe_place("data_dir", data_dir),
        _maybe_place("cache_dir", cache_dir),
    )
    return evaluate_run(
        folder, None if data is None else str(data), cache_dir=None if cache is None else str(cache)
    )


def predict_flight(
    run: Run | str | Path,
    flight: str | None = None,
    data_dir: str | Path | None = None,
    calibration_dir: str | Path | None = None,
    cloud_flag: str = "model",
):
    """Cloud base height along a whole flight, as ``predict`` writes it to ``<flight>_cbh.nc``.

    Parameters
    ----------
    run : Run, str or pathlib.Path
    flight : str, optional
        A flight's name (e.g. "01Mar25"), from the run's config or found in its data folder. Default: the
        run's first test flight.
    data_dir : str or pathlib.Path, optional
        Where the flight files are, if not where the run recorded them.
    calibration_dir : str or pathlib.Path, optional
        A folder whose ``intervals.json`` calibrates the intervals (a cross-validation's); default the
        run's own.
    cloud_flag : {"model", "bt_threshold"}
        Whose cloud flag the dataset holds: the model's, or the brightness-temperature baseline's.

    Returns
    -------
    xarray.Dataset
        Over ``time`` (with ``lat``, ``lon``): ``cloud_base_height`` (km) with its interval bounds,
        ``cloud_probability``, ``cloud_flag``, ``cloud_base_height_qc`` (4: the frame's inputs lie outside
        those trained on), ``input_distance``, the CPL label and flag where the flight has one; the global
        attributes of the NetCDF file (``inputs_vs_training``: the flight against the training inputs in
        words; the model's test skill on this flight where it was a test flight; the flight's role in the
        run, provenance). Nothing is written.
    """
    from cloudml_lib.science.predict import predict_datasets

    folder, flight = _folder(run), _flight(flight)
    data, calibration = _maybe_place("data_dir", data_dir), _maybe_place("calibration_dir", calibration_dir)
    if cloud_flag not in ("model", "bt_threshold"):
        raise ArgumentValueError(f"cloud_flag={shown(cloud_flag)}: expected 'model' or 'bt_threshold'")
    datasets = predict_datasets(
        folder,
        [flight] if flight else None,
        data_dir=None if data is None else str(data),
        calibration_dir=calibration,
        cloud_flag=cloud_flag,
    )
    return next(iter(datasets.values()))


def adapt(
    run: Run | str | Path,
    flight: str | None = None,
    labels: list[int] | tuple[int, ...] = (10, 25, 50),
    data_dir: str | Path | None = None,
) -> dict:
    """How much a few labels of a new flight recover: the run's network fine-tuned on the flight's first N
    labels in time, for each N of ``labels``, scored only on the labels after a gap, beside the baselines
    given the same N labels (science/adapt.py). Nothing is written.

    Parameters
    ----------
    run : Run, str or pathlib.Path
    flight : str, optional
        One of the run's test flights, or a new flight in its data folder (``data_dir``); never a flight it
        trained or validated on. Default: the run's first test flight.
    labels : list of int
        The label counts N to adapt on (0, the run as trained, is always scored too).
    data_dir : str or pathlib.Path, optional
        Where the flight files are (the run's training flights too), if not where the run recorded them.

    Returns
    -------
    dict
        ``curve`` (per N: ``network`` and each of ``baselines`` scored by r2, mae_km, rmse_km, bias_km;
        ``best_baseline`` and ``against_best``, the paired MAE difference with its interval and its call,
        better, worse or level; ``intervals``, their coverage on the scored part), ``gap_frames`` and
        ``gap_from``, ``scored_labels``, ``left_out`` (each N the flight cannot show, with the reason),
        ``role`` and ``words`` (the curve in sentences).
    """
    from cloudml_lib.science.adapt import adapt_run

    if not isinstance(labels, (list, tuple)) or not all(
        isinstance(n, int) and not isinstance(n, bool) for n in labels
    ):
        raise ArgumentTypeError(
            f"labels={shown(labels)}: expected a list of whole numbers such as [10, 25, 50]"
        )
    if not all(n >= 1 for n in labels):
        raise ArgumentValueError(
            f"labels={shown(labels)}: expected counts of 1 or more, such as [10, 25, 50]"
        )
    folder, flight, data = _folder(run), _flight(flight), _maybe_place("data_dir", data_dir)
    return adapt_run(folder, flight, list(labels), None if data is None else str(data))


def read_report(run: Run | str | Path) -> dict:
    """A finished run's report as data (``evaluation.json``, checked for type and range).

    Returns
    -------
    dict
        The scores on the test flights: ``overall`` (the model's r2, and mae_km, rmse_km, bias_km in km),
        ``per_flight`` (the same per test flight), ``baseline`` and ``baselines`` (the training mean and the
        fitted baselines, scored alike), ``verdict`` and ``flight_verdicts`` (in words: whether a baseline
        wins), ``cloud`` (the cloud flag against its baselines), ``intervals`` (their coverage), and the
        ``protocol`` it was tested under.

    Raises
    ------
    cloudml_lib.CloudMLError
        Where the run has no valid evaluation (not finished, its file damaged, or of other weights than
        best.pt holds now): the message says which.
    """
    folder = _folder(run)
    # an evaluation of other weights or another step than the run's is not its report (the state says which)
    report = folder.files.evaluation() if folder.state().kind != "trained" else None
    if not report:
        raise CloudMLError(
            f"{shown(str(folder.path))} has no valid evaluation.json (the run is "
            f"{folder.state().words}): finish the run (train it again with the same config), or evaluate it"
        )
    return report


def export(run: Run | str | Path, out: str | Path | None = None) -> Path:
    """Write the run's model for use without CloudML (``export`` on the command line).

    Returns
    -------
    pathlib.Path
        The export folder: ``weights.safetensors``, ``model.pt2``, ``preprocessing.json``, ``MODEL_CARD.md``.
    """
    from cloudml_lib.science.export import export_run

    return export_run(_folder(run), _maybe_place("out", out))
