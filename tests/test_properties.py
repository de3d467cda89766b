"""What a user types and writes, by class (issue 36): random and wrong-shaped config and space documents, and
random arguments to every command, give exit 0 or exit 2 with one bounded message: never a traceback, an
exception or a run that does not end. Hypothesis, derandomized, bounded examples; every command runs
in-process (`cli.main`, argparse's SystemExit caught) with the work past its checks (training, a sweep's
trials, predicting, writing demo flights) replaced by a stub that only records that it was reached."""

import argparse
from pathlib import Path

import pytest
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_runfiles import json_values, mutate

from cloudml_lib.commands import cli

REPO = Path(__file__).resolve().parents[1]
PROPERTY = settings(
    max_examples=40,
    derandomize=True,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
CONFIG = yaml.safe_load((REPO / "configs" / "demo.yaml").read_text())
SPACE = yaml.safe_load((REPO / "configs" / "sweeps" / "demo.yaml").read_text())
# Where each command's work begins once its arguments, config and space were accepted.
WORK = (
    "cloudml_lib.commands.runs.train_run",
    "cloudml_lib.commands.crossval.crossval",
    "cloudml_lib.commands.sweep.require_optuna",
    "cloudml_lib.science.predict.predict_flights",
    "cloudml_lib.science.evaluate.evaluate_run",
    "cloudml_lib.data.synthetic.make_demo_flights",
    "cloudml_lib.data.synthetic.ensure_demo_flights",
)


class Reached(Exception):
    """The command accepted what it was given and got to its work (stubbed)."""


@pytest.fixture
def stubbed(monkeypatch, tmp_path):
    def reached(*args, **kwargs):
        raise Reached

    for target in WORK:
        monkeypatch.setattr(target, reached)
    monkeypatch.chdir(tmp_path)
    return tmp_path


def outcome(argv: list[str], capsys) -> str:
    """ "work" when the command got past its checks, "ok" for exit 0, else asserts exit 2 with one short
    message and no traceback, and returns the message."""
    try:
        code = cli.main(argv)
    except Reached:
        capsys.readouterr()
        return "work"
    except SystemExit as e:  # argparse's refusal of an argument
        code = e.code
    out, err = capsys.readouterr()
    if code == 0:
        return "ok"
    assert code == 2, (argv, code, out[-800:], err[-1500:])
    assert "Traceback" not in out + err, (argv, err[-3000:])
    message = err[err.index("error: ") :]
    assert 20 < len(message) < 5000, (argv, message[:300], len(message))
    return message


def write(folder: Path, name: str, doc) -> Path:
    path = folder / name
    path.write_text(doc if isinstance(doc, str) else yaml.safe_dump(doc))
    return path


def wrong_document(base: dict, data):
    """The valid document with one value somewhere replaced, random YAML data, or random text."""
    kind = data.draw(st.sampled_from(["mutated", "mutated", "random", "text"]))
    if kind == "mutated":
        return mutate(base, data)
    if kind == "random":
        return data.draw(json_values)
    return data.draw(st.text(max_size=80))


@PROPERTY
@given(data=st.data())
def test_any_config_is_trained_on_or_refused_with_one_message(stubbed, capsys, data):
    config = write(stubbed, "config.yaml", wrong_document(CONFIG, data))
    result = outcome(["train", "--config", str(config), "--run-dir", str(stubbed / "run")], capsys)
    assert result in ("work", "ok") or "config.yaml" in result or "--set" in result, result


@PROPERTY
@given(data=st.data())
def test_any_sweep_space_is_run_or_refused_with_one_message(stubbed, capsys, data):
    space = write(stubbed, "space.yaml", wrong_document(SPACE, data))
    trials = str(data.draw(st.sampled_from([1, 3, 0, -1, 2**40])))
    argv = ["sweep", "--preset", "demo", "--space", str(space), "--trials", trials, "--run-dir", "sw"]
    result = outcome(argv, capsys)
    assert result == "work" or "space" in result or "--trials" in result or "seed" in result, result


@settings(PROPERTY, max_examples=25)
@given(data=st.data(), override=st.text(max_size=40))
def test_any_set_override_is_applied_or_refused_with_one_message(stubbed, capsys, data, override):
    key = data.draw(st.sampled_from(["train.epochs", "model.dropout", "data.flights", "x", "train", ""]))
    text = data.draw(st.sampled_from([override, f"{key}={override}", f"{key}=[{override}]"]))
    result = outcome(["train", "--preset", "demo", "--run-dir", "run", "--set", text], capsys)
    assert result == "work" or "--set" in result or "config" in result, result


def _subcommands() -> dict[str, argparse.ArgumentParser]:
    parser = cli.build_parser()
    return next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction)).choices


COMMANDS = _subcommands()
VALUES = ["", " ", "x", "-1", "0", "2", "1e400", "nan", "demo", "auto", "Z", "²", "x" * 3000, "a.b=c"]


@settings(PROPERTY, max_examples=30)
@pytest.mark.parametrize(  # diagnose: 5 s or more once (it looks at the machine)
    "command", [pytest.param(c, marks=pytest.mark.slow) if c == "diagnose" else c for c in sorted(COMMANDS)]
)
@given(data=st.data())
def test_any_arguments_to_any_command_end_in_exit_0_or_2(stubbed, capsys, command, data):
    """Tokens drawn from the command's own options, paths (missing, a file, the folder itself) and odd
    values."""
    options = [s for a in COMMANDS[command]._actions for s in a.option_strings if s not in ("-h", "--help")]
    (stubbed / "file.txt").write_text("not a config\n")
    paths = [str(stubbed / "missing"), str(stubbed / "file.txt"), str(stubbed), "runs/new"]
    tokens = st.sampled_from(options) | st.sampled_from(paths + VALUES)
    argv = [command, *data.draw(st.lists(tokens, max_size=7))]
    outcome(argv, capsys)
