"""Files a command writes: never through a symbolic link, and only into a folder of its own."""

import pytest
import torch

from cloudml_lib.base.errors import CloudMLError
from cloudml_lib.base.logs import attach_run_log
from cloudml_lib.base.outputs import append_text, write_text
from cloudml_lib.core.run.checkpoint import save_atomic
from cloudml_lib.core.run.folder import RunFolder
from cloudml_lib.core.run.runfolder import truncate_metrics


@pytest.fixture
def linked(tmp_path):
    """A run folder whose file `name` is a symbolic link to a file outside it."""
    outside = tmp_path / "outside.txt"
    outside.write_text("someone else's file\n")
    run = tmp_path / "run"
    run.mkdir()

    def link(name):
        (run / name).symlink_to(outside)
        return run / name

    return outside, link


@pytest.mark.parametrize(
    "name, write",
    [
        ("metrics.jsonl", lambda p: append_text(p, '{"kind": "step"}\n')),
        ("metrics.jsonl", lambda p: truncate_metrics(p, 0)),  # a resume cutting records it will redo
        ("run.json", lambda p: write_text(p, "{}")),
        ("best.pt", lambda p: save_atomic({"model": {}}, p)),
        ("train.log", lambda p: attach_run_log(RunFolder(p.parent))),
    ],
)
def test_a_run_file_that_is_a_symbolic_link_is_refused_and_its_target_untouched(linked, name, write):
    outside, link = linked
    path = link(name)
    with pytest.raises(CloudMLError) as e:
        write(path)
    assert f"{path} is a symbolic link (to {outside})" in str(e.value) and "Remove the link" in str(e.value)
    assert outside.read_text() == "someone else's file\n"
    assert path.is_symlink()  # left as it was: the user decides
    attach_run_log(None)


def test_run_files_that_are_real_files_are_written_as_before(tmp_path):
    append_text(tmp_path / "metrics.jsonl", "a\n")
    append_text(tmp_path / "metrics.jsonl", "b\n")
    truncate_metrics(tmp_path / "metrics.jsonl", 2)
    assert (tmp_path / "metrics.jsonl").read_text() == "a\n"
    save_atomic({"x": torch.ones(2)}, tmp_path / "best.pt")
    assert torch.equal(torch.load(tmp_path / "best.pt", weights_only=True)["x"], torch.ones(2))
    # a link planted under the temporary name is not written through either
    (tmp_path / "decoy").write_text("keep")
    (tmp_path / ".run.json.tmp-123").symlink_to(tmp_path / "decoy")
    write_text(tmp_path / "run.json", "{}")
    assert (tmp_path / "run.json").read_text() == "{}" and (tmp_path / "decoy").read_text() == "keep"


# Which folders are CloudML's (new, empty, hidden-only, marked or adopted): tests/test_ownership.py
