"""`python -m cloudml_lib ...`: train, crossval, sweep, compare, predict, evaluate, status, diagnose, labels,
make-demo-data.

Exit status: 0 on success; 2 for a usage, config or data error (`labels`: a flight that cannot be used),
a full or read-only disk, a run folder that is not the run's (one short message, no traceback, each value it
echoes bounded: errors.shown); 130 when stopped by Ctrl-C or SIGTERM at any moment, set-up included
(progress saved); 1 for anything unexpected (with the traceback, to report).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import sys
import threading
import time
from pathlib import Path

from cloudml_lib.base.errors import CloudMLError, explain_os_error, shown
from cloudml_lib.base.layout import RunLayout

log = logging.getLogger(__name__)


def threading_main() -> bool:
    return threading.current_thread() is threading.main_thread()


class _Parser(argparse.ArgumentParser):
    def error(self, message):  # argparse's own exit code is 2 as well
        self.print_usage(sys.stderr)
        if len(message) > MAX_MESSAGE_CHARS:  # it quotes the argument, which may be huge
            message = message[:MAX_MESSAGE_CHARS] + " ..."
        self.exit(2, f"error: {message}\n")


def _at_once(text: str) -> int:
    """--parallel: a whole number >= 1."""
    try:
        n = int(text)
    except ValueError:
        n = 0
    if n < 1:
        raise argparse.ArgumentTypeError(
            f"{text!r} is not a whole number >= 1: how many run at once, one process each (1, the default, "
            "runs them one after another)"
        )
    return n


def _folder(text: str) -> str:
    """A folder argument: an empty one would silently mean the working directory (or a default). A path
    through `..` or a symbolic link is resolved first (shown so), so that what is checked is where files land:
    `runs/never_made/../H` is runs/H, and was checked as a new folder (never_made is not there), then
    written into runs/H."""
    if not text.strip():
        raise argparse.ArgumentTypeError(
            f"{text!r} is empty; name a folder: a new or empty one for what the command writes, or an "
            "existing run folder"
        )
    nearest = Path(os.path.abspath(text))  # the deepest part that is there (a link counted as there)
    while not os.path.lexists(nearest) and nearest != nearest.parent:
        nearest = nearest.parent
    if nearest.is_symlink() and not nearest.exists():
        return text  # a link to nowhere, or a loop: the folder check names it
    real = os.path.realpath(text)
    return text if real == os.path.abspath(text) and ".." not in Path(text).parts else real


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(prog="python -m cloudml_lib", description="CloudML: cloud base height from ER-2 IR frames")
    from cloudml_lib import __version__

    p.add_argument("--version", action="version", version=f"CloudML {__version__}")
    sub = p.add_subparsers(dest="command", required=True, parser_class=_Parser)
    _add_training_commands(sub)
    _add_result_commands(sub)
    _add_data_commands(sub)
    return p


def _set_argument(parser, example: str = ", e.g. --set train.epochs=3") -> None:
    parser.add_argument(
        "--set",
        dest="overrides",
        action="append",
        default=[],
        metavar="SECTION.KEY=VALUE",
        help=f"override one config value; repeatable{example}",
    )


def _data_dir_argument(parser, moved: bool = False) -> None:
    parser.add_argument(
        "--data-dir",
        type=_folder,
        help="folder of the flight files, if they moved since training"
        if moved
        else "folder of the flight files (overrides data.dir)",
    )


def _cache_dir_argument(parser) -> None:
    parser.add_argument(
        "--cache-dir",
        type=_folder,
        help="where the preprocessing cache goes if the run's recorded data.cache_dir is not this "
        "machine's (a run trained on Colab, used elsewhere)",
    )


def _add_training_commands(sub) -> None:
    """train, crossval, sweep: the commands that train, each resumable."""
    t = sub.add_parser("train", help="train a model (on the demo flights with --preset demo)")
    _config_arguments(t)
    t.add_argument("--run-dir", type=_folder, help="where the run's files go (default: runs/<config name>)")
    _data_dir_argument(t)
    _set_argument(t)
    t.add_argument(
        "--resume",
        default="auto",
        metavar="auto|never|PATH",
        help="auto (default): continue from the newest valid checkpoint in the run directory; "
        "never: refuse to touch an existing run; PATH: continue from that checkpoint",
    )
    c = sub.add_parser("crossval", help="leave-one-flight-out cross-validation with baselines (resumable)")
    _config_arguments(c)
    c.add_argument(
        "--run-dir", type=_folder, required=True, help="where the folds, crossval.json and crossval.md go"
    )
    _data_dir_argument(c)
    _set_argument(c, "")
    c.add_argument(
        "--no-controls", action="store_true", help="skip the scalars-only control runs (half the time)"
    )
    _parallel_argument(c, "folds", "")
    sw = sub.add_parser(
        "sweep",
        help="a hyperparameter search (Optuna): trials as resumable runs; killed, "
        "it continues where it stopped",
    )
    _config_arguments(sw, "the config the trials start from")
    sw.add_argument(
        "--space",
        help="YAML search space (default: the packaged configs/sweeps/demo.yaml, made for --preset demo)",
    )
    sw.add_argument(
        "--trials", type=int, required=True, help="how many trials in all (raise it to add trials)"
    )
    _parallel_argument(sw, "trials", ", reproducible to the value")
    sw.add_argument(
        "--rebuild-study",
        action="store_true",
        help="when study.journal is lost or damaged: rebuild the study from the trial folders "
        "(their values, results and epoch scores); without it such a sweep is refused",
    )
    sw.add_argument(
        "--run-dir",
        type=_folder,
        required=True,
        help="the sweep folder: trials/<n>, study.journal, report.md",
    )
    _data_dir_argument(sw)
    _set_argument(sw, " (for every trial)")


def _parallel_argument(p, what: str, serial: str) -> None:
    p.add_argument(
        "--parallel",
        type=_at_once,
        default=1,
        metavar="N",
        help=f"train N {what} at once on this machine, one process each (a GPU each where there are several, "
        f"else the CPU cores shared out); default 1: one after another{serial}",
    )


def _add_result_commands(sub) -> None:
    """compare, predict, export, status, evaluate: the commands that read runs."""
    cm = sub.add_parser(
        "compare",
        help="runs, cross-validations or sweep trials side by side: the settings "
        "that differ, test metrics (a sweep trial's: validation), epochs, time, compiled",
    )
    cm.add_argument("run_dirs", nargs="+", metavar="DIR", type=_folder)
    cm.add_argument("--json", action="store_true", help="print one JSON list instead of a table")
    pr = sub.add_parser(
        "predict", help="cloud base height for every frame of whole flights (NetCDF, CSV, plots)"
    )
    pr.add_argument("--run-dir", type=_folder, required=True, help="a trained run (its best.pt is used)")
    pr.add_argument(
        "--flights",
        nargs="+",
        metavar="NAME",
        help="flights to predict (default: the run's "
        "test flights); any flight found in data.dir, the CPL file optional",
    )
    pr.add_argument("--out", type=_folder, help="folder for the files (default: RUN_DIR/predictions)")
    _data_dir_argument(pr, moved=True)
    _cache_dir_argument(pr)
    pr.add_argument(
        "--calibration",
        metavar="DIR",
        type=_folder,
        help="calibrate the prediction intervals with "
        "DIR/intervals.json (a cross-validation's: the error on flights never seen); default: the "
        "run's own",
    )
    pr.add_argument(
        "--cloud-flag",
        choices=("model", "bt_threshold"),
        default="model",
        help="whose cloud flag the files hold (and so where a height is given): the model's (default), or "
        "bt_threshold, the brightness-temperature baseline fitted on the training flights, for a run whose "
        "verdict says it beats the model; each file says which it holds",
    )
    ex = sub.add_parser(
        "export",
        help="a run's best model as files a colleague loads without CloudML: torch.export program, "
        "safetensors weights, the inputs' preprocessing as JSON, a model card",
    )
    ex.add_argument("--run-dir", type=_folder, required=True, help="a trained run (its best.pt is exported)")
    ex.add_argument("--out", type=_folder, help="folder for the files (default: RUN_DIR/export)")
    s = sub.add_parser(
        "status", help="where a run stands: epoch, step, progress, best metric, latest checkpoint"
    )
    s.add_argument("run_dir", type=_folder)
    s.add_argument("--json", action="store_true", help="print one JSON object")
    _add_adapt_command(sub)
    e = sub.add_parser("evaluate", help="score a run's best model on its test flights")
    e.add_argument("--run-dir", type=_folder, required=True)
    _data_dir_argument(e, moved=True)
    _cache_dir_argument(e)
    e.add_argument("--json", action="store_true", help="print one JSON object instead of a table")


def _add_adapt_command(sub) -> None:
    """adapt: a few labels of a flight, scored honestly (science/adapt.py)."""
    ad = sub.add_parser(
        "adapt",
        help="how much a few labels of a flight recover: the run's network fine-tuned on its first N labels, "
        "scored after a gap beside the baselines given the same N (nothing is written)",
    )
    ad.add_argument("--run-dir", type=_folder, required=True, help="a finished run")
    ad.add_argument(
        "--flight",
        metavar="NAME",
        help="one of the run's test flights, or a new flight found in data.dir (default: its first test "
        "flight)",
    )
    ad.add_argument(
        "--labels",
        type=int,
        nargs="+",
        default=[10, 25, 50],
        metavar="N",
        help="the label counts to adapt on (default: 10 25 50)",
    )
    _data_dir_argument(ad, moved=True)
    ad.add_argument("--json", action="store_true", help="print one JSON object instead of sentences")


def _add_data_commands(sub) -> None:
    """labels, diagnose, make-demo-data: the data and the machine, nothing trained."""
    lb = sub.add_parser(
        "labels",
        help="the labels a config yields, per flight and filter (no frames read, no "
        "training), e.g. with --preset published",
    )
    _config_arguments(lb, "e.g. --preset published: the users' published label sets")
    _data_dir_argument(lb)
    _set_argument(lb, ", e.g. --set data.label_layer=top")
    g = sub.add_parser("diagnose", help="the machine, its memory and what to use on it")
    _config_arguments(g, "also check the disk and cache for this config", required=False)
    g.add_argument("--json", action="store_true", help="print one JSON object")
    g.add_argument(
        "--runs",
        type=_folder,
        default=None,
        help="a folder of your runs: beside the estimate, what the newest run with each preset's step "
        "measured on this kind of device",
    )
    f = sub.add_parser(
        "fetch-era5",
        help="ERA5 for your flights from the Climate Data Store (your key): the box and hours of each "
        "flight from its nav file, into its folder; a second run fetches only what is missing",
    )
    _config_arguments(f, "the flights of this config")
    _data_dir_argument(f)
    _set_argument(f, "")
    f.add_argument("--flights", nargs="+", default=None, help="only these flights (default: every one)")
    f.add_argument(
        "--no-levels", action="store_true", help="single levels only (no pressure levels: no LTS or EIS)"
    )
    f.add_argument("--dry-run", action="store_true", help="print the requests, fetch nothing")
    d = sub.add_parser("make-demo-data", help="write synthetic flights in the real ER-2 file layout")
    d.add_argument("--out", type=_folder, required=True, help="folder to write the flight files into")
    d.add_argument("--flights", type=int, default=5, help="number of flights (default 5, at least 2)")
    d.add_argument("--seed", type=int, default=0)
    d.add_argument("--frames", type=int, default=1400, help="frames per flight (default 1400)")
    d.add_argument(
        "--size", default="80x96", help="raw frame ROWSxCOLS (default 80x96; the real camera: 512x640)"
    )
    d.add_argument(
        "--generator",
        type=int,
        default=None,
        help="the generator version (default: the newest, 4: version 3's flights with ERA5 files of their "
        "atmosphere beside them; 3: the cloud's top in the frames, its base a varying thickness below, no "
        "ERA5; 2: CloudML 0.3's easy demo; each byte for byte, for the runs made on it)",
    )


PRESETS = ("auto", "A", "B", "C", "demo", "published")


def _config_arguments(parser, what: str = "", required: bool = True) -> None:
    """--config FILE or --preset NAME (the presets travel with the package: no checkout needed)."""
    which = parser.add_mutually_exclusive_group(required=required)
    which.add_argument(
        "--config", metavar="FILE", help="YAML file, e.g. configs/demo.yaml" + (f"; {what}" if what else "")
    )
    which.add_argument(
        "--preset",
        choices=PRESETS,
        help="a packaged config: A, B, C (Colab GPU presets), demo (CPU "
        "demo flights), published (the users' published labels); auto: for the GPU at hand",
    )


def config_path(args) -> Path | None:
    """The YAML file of --config, or of --preset (auto resolved for this machine)."""
    from cloudml_lib.commands.presets import choose_preset, preset_config_path, system_report

    if not getattr(args, "preset", None):
        return Path(args.config) if getattr(args, "config", None) else None
    name = args.preset
    if name == "auto":
        name, why = choose_preset(system_report())
        log.info("Preset auto: %s, because %s", name, why)
    return preset_config_path(name)


def _overrides(args) -> list[str]:
    return list(args.overrides) + ([f"data.dir={args.data_dir}"] if args.data_dir else [])


def _train(args) -> int:
    from cloudml_lib.base.config import load_config
    from cloudml_lib.commands import api

    config = config_path(args)
    cfg = load_config(config, _overrides(args))
    run_dir = Path(args.run_dir) if args.run_dir is not None else Path("runs") / Path(config).stem
    api.fit(cfg, run_dir, resume=args.resume)
    return 0


def _crossval(args) -> int:
    from cloudml_lib.base.config import load_config
    from cloudml_lib.commands.crossval import crossval
    from cloudml_lib.core.run.folder import RunFolder

    crossval(
        load_config(config_path(args), _overrides(args)),
        RunFolder(args.run_dir),
        controls=not args.no_controls,
        parallel=args.parallel,
    )
    return 0


def _sweep(args) -> int:
    from cloudml_lib.base.ownership import check
    from cloudml_lib.base.resources import config_file
    from cloudml_lib.commands.sweep import SWEEP, sweep
    from cloudml_lib.core.run.folder import RunFolder
    from cloudml_lib.core.run.runfolder import check_run_writes

    check(Path(args.run_dir), SWEEP)  # new, empty or a sweep's own, before anything is written
    check_run_writes(RunLayout(args.run_dir))
    space = args.space or config_file("sweeps/demo.yaml")
    result = sweep(
        config_path(args),
        space,
        args.trials,
        RunFolder(args.run_dir),
        _overrides(args),
        rebuild=args.rebuild_study,
        parallel=args.parallel,
    )
    if result.get("best"):
        b = result["best"]
        print(
            f"best: trial {b['number']}, {result['metric']} {b['value']:.4g}, "
            + ", ".join(f"{k}={v}" for k, v in b["params"].items())
        )
    if result:
        print(f"report: {RunLayout(Path(args.run_dir)).newest_report}")
    failed = [t for t in result.get("trials", []) if t["state"] == "fail"]
    if failed and len(failed) == len(result["trials"]):
        raise CloudMLError(
            f"none of the {len(failed)} trial(s) could run; trial {failed[0]['number']}: {failed[0]['note']} "
            "Change the space or the config, then start a new sweep in another --run-dir (failed trials "
            "are final in this one)."
        )
    return 0


def _compare(args) -> int:
    from cloudml_lib.base.outputs import json_safe
    from cloudml_lib.commands.compare import compare_runs, format_comparison
    from cloudml_lib.core.run.folder import RunFolder

    rows = compare_runs([RunFolder(d) for d in args.run_dirs])
    print(json.dumps(json_safe(rows)) if args.json else format_comparison(rows))
    return _said_damage([d for r in rows for d in r["damaged"]])


def _said_damage(damaged: list[str]) -> int:
    """Exit 2 after what could be read was shown, when a run file could not be."""
    if not damaged:
        return 0
    others = " and the others named above" if len(damaged) > 1 else ""
    print(
        f"error: {len(damaged)} run file(s) could not be read: {damaged[0]}{others}. Everything else is "
        "shown above and nothing was changed. Restore the file from a copy, or move it aside: a resumed "
        "training run writes config.yaml and run.json again, and `python -m cloudml_lib evaluate RUN_DIR` "
        "writes evaluation.json again.",
        file=sys.stderr,
    )
    return 2


def _predict(args) -> int:
    from cloudml_lib.core.run.folder import RunFolder
    from cloudml_lib.science.predict import predict_flights

    for path in predict_flights(
        RunFolder(args.run_dir),
        args.flights,
        args.out,
        args.data_dir,
        args.calibration,
        cache_dir=args.cache_dir,
        cloud_flag=args.cloud_flag,
    ):
        print(f"wrote {path}")
    return 0


def _export(args) -> int:
    from cloudml_lib.commands import api
    from cloudml_lib.science.export import EXPORT_FILES

    folder = api.export(args.run_dir, args.out)
    print(f"wrote {', '.join(EXPORT_FILES)} to {folder}")
    return 0


def _labels(args) -> int:
    """Print the flight table (files, profiles, labels kept, removed by each filter, match rate, flips) and
    the label definition; exit 2 when a flight is unusable (its files: a data problem), naming it."""
    from cloudml_lib.base.config import load_config
    from cloudml_lib.data import cpl, flights
    from cloudml_lib.data.synthetic import ensure_demo_flights

    cfg = load_config(config_path(args), _overrides(args))
    data = ensure_demo_flights(cfg.data)
    notes = flights.Notes()
    rows, ok = flights.check_rows(data, notes)
    if not rows:
        raise CloudMLError(
            f"no ER-2 flight files found in data.dir ({data.dir}) or its sub-folders; point "
            "--data-dir at the folder holding your flights"
        )
    print(flights.format_table(rows) + ("\n" + notes.text() if notes else ""))
    total = sum(int(r[6]) for r in rows if r[6].isdigit())
    print(
        f"\n{total} labels in {len(rows)} flights. Label definition: "
        + ", ".join(f"{k} {v}" for k, v in cpl.label_definition(data).items())
    )
    if ok:
        return 0
    unusable = [r[0] for r in rows if not r[6].isdigit()]
    print(
        f"error: {len(unusable) or 'some'} of {len(rows)} flights cannot be used"
        + (f" ({', '.join(unusable)})" if unusable else "")
        + ": the table's notes above say why. Fix or replace their files, or move them out of data.dir "
        "(a run can skip a flight that lacks a file: data.skip_incomplete_flights: true).",
        file=sys.stderr,
    )
    return 2


def _fetch_era5(args) -> int:
    """Fetch the flights' missing ERA5 files; --dry-run prints the requests."""
    import json

    from cloudml_lib.base.config import load_config
    from cloudml_lib.commands import era5

    cfg = load_config(config_path(args), _overrides(args))
    if args.dry_run:
        for flight, path, request in era5.plan(cfg, args.flights, not args.no_levels):
            if path.exists():  # a real run keeps it (read back as ERA5 first): nothing to fetch
                print(f"{flight}: {path} is there already: kept")
            else:
                print(f"{flight}: {path} <- {request.dataset} {json.dumps(request.keys)}")
        return 0
    done = era5.fetch(cfg, args.flights, not args.no_levels)
    print(
        f"ERA5: {len(done['fetched'])} file(s) fetched, {len(done['kept'])} already there "
        f"({len(done['planned'])} for the flights)"
    )
    return 0


def _diagnose(args) -> int:
    from cloudml_lib.commands.presets import (
        format_machine,
        memory_header,
        memory_rows,
        memory_table,
        recommendations,
        system_report,
    )

    paths, cache_bytes = {}, None
    if args.config or args.preset:
        from cloudml_lib.base.config import load_config
        from cloudml_lib.data.cache import cache_root

        cfg = load_config(config_path(args))
        paths = {"data": cfg.data.dir, "cache": str(cache_root(cfg.data))}
        frames = list(cache_root(cfg.data).glob("*/frames.npy"))
        cache_bytes = sum(f.stat().st_size for f in frames) if frames else None
    report = system_report(paths)
    report["recommendations"] = recommendations(report, cache_bytes)
    free = report["gpu"]["free_bytes"] if report["gpu"] else None
    runs = Path(args.runs) if args.runs else None
    if runs is not None and not runs.is_dir():
        from cloudml_lib.base.errors import CloudMLError

        raise CloudMLError(f"diagnose --runs {runs}: no such folder; name the folder that holds your runs")
    report["preset_memory"] = [dict(zip(memory_header(runs), row)) for row in memory_rows(free, runs)]
    if args.json:
        print(json.dumps(report))
    else:
        print(format_machine(report))
        print("\nGPU memory of a training step, each preset at its batch:")
        print(memory_table(free, runs=runs))
        print("\nRecommendations:")
        for line in report["recommendations"]:
            print(f"  - {line}")
    return 0


def _status(args) -> int:
    from cloudml_lib.core.run.folder import RunFolder
    from cloudml_lib.core.run.status import format_status

    if (Path(args.run_dir) / "sweep.json").is_file():  # a sweep: where each of its trials stands
        return _compare(argparse.Namespace(run_dirs=[args.run_dir], json=args.json))
    status = RunFolder(args.run_dir).status()
    print(json.dumps(status) if args.json else format_status(status))
    return _said_damage(status.get("damaged", []))


def _evaluate(args) -> int:
    from cloudml_lib.base.outputs import json_safe
    from cloudml_lib.commands import api
    from cloudml_lib.science.report import format_report

    report = api.evaluate(args.run_dir, data_dir=args.data_dir, cache_dir=args.cache_dir)
    if args.json:
        print(json.dumps(json_safe(report), allow_nan=False))
    else:
        print(format_report(report))
        print(f"predictions: {Path(args.run_dir) / 'predictions.csv'}")
    return 0


def _adapt(args) -> int:
    from cloudml_lib.base.outputs import json_safe
    from cloudml_lib.commands import api

    record = api.adapt(args.run_dir, args.flight, args.labels, data_dir=args.data_dir)
    if args.json:
        print(json.dumps(json_safe(record), allow_nan=False))
    else:
        print("\n".join(record["words"]))
    return 0


def _make_demo(args) -> int:
    from cloudml_lib.base.ownership import check
    from cloudml_lib.data.synthetic import DEMO, DEMO_VERSION, make_demo_flights

    try:
        rows, cols = (int(v) for v in args.size.lower().split("x"))
    except ValueError:
        raise CloudMLError(f"--size {shown(args.size)}: expected ROWSxCOLS, e.g. 80x96") from None
    check(args.out, DEMO)  # new, empty, or earlier demo flights: before anything is written
    if rows < 16 or cols < 16 or args.frames < 10:
        raise CloudMLError("--size must be at least 16x16 and --frames at least 10")
    try:
        entries = make_demo_flights(
            args.out,
            n_flights=args.flights,
            seed=args.seed,
            frames_per_flight=args.frames,
            frame_shape=(rows, cols),
            version=DEMO_VERSION if args.generator is None else args.generator,
        )
    except ValueError as e:
        raise CloudMLError(str(e)) from None
    print(
        f"wrote {len(entries)} flights to {args.out}, one folder each: "
        f"{', '.join(e['name'] for e in entries)}.\n"
        f"They are found by their file names, like real flights: set data.dir: {args.out} (and leave "
        "data.flights empty), e.g. (a run folder of their own: runs/demo holds the built-in demo's run)\n"
        f"  python -m cloudml_lib train --config configs/demo.yaml --set data.dir={args.out} "
        f"--run-dir runs/{Path(args.out).name or 'demo_flights'}"
    )
    return 0


def _stop_on_sigterm(signum, frame):
    raise KeyboardInterrupt("SIGTERM")  # before the training loop traps it: stop cleanly, exit 130


def trap_stop_signals() -> None:
    """SIGTERM and SIGINT become KeyboardInterrupt from the first line of `python -m cloudml_lib` on, so
    that a stop at any moment, set-up included, ends with exit status 130 (never killed by the signal)."""
    if threading_main():
        signal.signal(signal.SIGTERM, _stop_on_sigterm)
        signal.signal(signal.SIGINT, signal.default_int_handler)


def watch_parent() -> None:
    """With CLOUDML_PARENT_PID (a notebook started this command in a session of its own, out of reach of the
    kernel's interrupts): when that process is gone (the kernel restarted or died), stop as on SIGTERM, at
    the next step with a checkpoint, instead of running on unseen and holding the run's lock."""
    parent = int(os.environ.get("CLOUDML_PARENT_PID", "0") or 0)
    if not parent:
        return

    def watch():
        while True:
            time.sleep(2.0)
            if os.getppid() != parent:
                os.kill(os.getpid(), signal.SIGTERM)
                return

    threading.Thread(target=watch, name="cloudml-parent-watch", daemon=True).start()


def _places(args) -> dict[str, str]:
    import tempfile

    return {
        "run folder": getattr(args, "run_dir", None),
        "output folder": getattr(args, "out", None),
        "temporary folder": tempfile.gettempdir(),
    }


MAX_MESSAGE_CHARS = 4000  # a safety net: each value a message echoes is bounded already (errors.shown)


def _print_error(message: str) -> None:
    """The command's last word on the console, and in the run's train.log when one is attached (a run that
    ended this way says so in its own log, not only on a screen that may be gone)."""
    from cloudml_lib.base.logs import to_run_log

    if len(message) > MAX_MESSAGE_CHARS:
        message = f"{message[:MAX_MESSAGE_CHARS]} ... ({len(message) - MAX_MESSAGE_CHARS} more characters)"
    print(f"error: {message}", file=sys.stderr)
    to_run_log(f"error: {message}")


def main(argv: list[str] | None = None) -> int:
    from cloudml_lib.base.logs import attach_run_log, to_run_log

    args = build_parser().parse_args(argv)
    trap_stop_signals()
    watch_parent()
    attach_run_log(None, console=sys.stderr if getattr(args, "json", False) else sys.stdout)
    try:
        return _run(args)
    except Exception:  # unexpected: the traceback goes to the console as before, and to train.log
        import traceback

        to_run_log(f"unexpected failure (please report it with this log):\n{traceback.format_exc()}".rstrip())
        raise


def _run(args) -> int:
    """The command, with a user's error (config, data, a full disk) as one message and exit status 2."""
    handlers = {
        "train": _train,
        "crossval": _crossval,
        "sweep": _sweep,
        "compare": _compare,
        "predict": _predict,
        "export": _export,
        "evaluate": _evaluate,
        "adapt": _adapt,
        "status": _status,
        "diagnose": _diagnose,
        "labels": _labels,
        "fetch-era5": _fetch_era5,
        "make-demo-data": _make_demo,
    }
    try:
        return handlers[args.command](args)
    except CloudMLError as e:
        _print_error(str(e))
        return 2
    except BrokenPipeError:  # the reader of the output left (`status RUN | head -n 1`): nothing is wrong
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # no second error at exit's flush
        return 141  # 128 + SIGPIPE, as a shell reports a command its pipe's reader left
    except OSError as e:
        message = explain_os_error(e, _places(args), resumes=args.command in ("train", "crossval", "sweep"))
        if message is None:
            raise
        _print_error(message)
        return 2
    except KeyboardInterrupt as e:
        print(
            f"interrupted{': ' + str(e) if str(e) else ''}. Run the same command again to resume.",
            file=sys.stderr,
        )
        return 130
