"""The compiled kernels kept from one machine to the next (a new Colab VM compiles from scratch otherwise).

torch.compile's inductor keeps what it compiled (graphs, Triton or C++ kernels) in a cache folder on the local
disk, which dies with a Colab VM: every new session paid the whole compile again (22 s on an H200 with an
empty cache against 14 s warm, minutes on a T4: benchmarks/results/gpu.json). A compiled run now keeps that
cache in a lasting folder: its run folder's `compile_cache/` (on Drive in the notebooks), or
`train.compile_cache_dir` (a folder of the user's, shared by runs). Inductor still works on the local disk
(fast, and its file locks stay local): at the start the lasting files are copied to a local folder that
inductor is pointed at (TORCHINDUCTOR_CACHE_DIR; one per machine, shared by its runs), and after compiling
what is new is copied back.

Nothing is lost or overwritten: a file is copied only where the other side lacks it, through a temporary name
and a rename (a copy cut by a disconnect leaves no half file under a real name), and nothing is ever deleted.
A cold cache (nothing kept yet) is said in plain words, with what the first step will cost.
"""

from __future__ import annotations

import getpass
import logging
import os
import shutil
import tempfile
from pathlib import Path

from cloudml_lib.base import ledger

log = logging.getLogger(__name__)

INDUCTOR_ENV = "TORCHINDUCTOR_CACHE_DIR"
LOCAL_ENV = "CLOUDML_COMPILE_LOCAL"  # where the local copies live (default: the temporary folder)
PARTIAL = ".cloudml-partial-"  # the prefix of a file being copied


def _files(root: Path) -> dict[str, int]:
    """The relative path and size of every whole file under `root` (lock and half-copied files left out)."""
    found = {}
    if not root.is_dir():
        return found
    for path in root.rglob("*"):
        if path.is_file() and not path.is_symlink() and not path.name.startswith(PARTIAL):
            if not path.name.endswith(".lock"):
                found[path.relative_to(root).as_posix()] = path.stat().st_size
    return found


def _copy_missing(source: Path, target: Path) -> int:
    """Copy each file of `source` that `target` lacks (through a temporary name); returns how many."""
    have, copied = _files(target), 0
    for rel in _files(source).keys() - have.keys():
        dest = target / rel
        try:
            dest.parent.mkdir(parents=True, exist_ok=True)
            partial = dest.with_name(f"{PARTIAL}{os.getpid()}-{dest.name}")
            shutil.copyfile(source / rel, partial)
            os.replace(partial, dest)
            copied += 1
        except OSError as e:  # a full Drive, a file gone meanwhile: the cache is an aid, never a failure
            log.info("compile cache: %s not copied (%s)", rel, e)
    return copied


def user_name() -> str:
    """The user's name, for a folder name (the uid where the system has none for it, as in a container)."""
    try:
        name = getpass.getuser()
    except (KeyError, OSError, ImportError):
        name = str(os.getuid()) if hasattr(os, "getuid") else "user"
    return "".join(c if c.isalnum() or c in "-_." else "_" for c in name) or "user"


class CompileCache:
    """A lasting folder of compiled kernels and the local folder inductor works in: one per machine
    ($CLOUDML_COMPILE_LOCAL, else a TORCHINDUCTOR_CACHE_DIR the user set, else the temporary folder's
    cloudml-compile-cache-<user>), shared by the runs on it, as inductor's own cache is: its files are named
    by what they hold, so a second run of the same model on the machine compiles warm."""

    def __init__(self, lasting: Path, local: Path | None = None):
        self.lasting = Path(lasting)
        base = os.environ.get(LOCAL_ENV) or os.environ.get(INDUCTOR_ENV)
        # one per user, as inductor's own (/tmp/torchinductor_<user>): a shared /tmp on a cluster's node
        default = Path(tempfile.gettempdir()) / f"cloudml-compile-cache-{user_name()}"
        self.local = Path(local or base or default)
        self.brought = 0

    def open(self) -> str:
        """Copy the kept kernels to the local folder and point inductor at it; returns the notice."""
        self.local.mkdir(parents=True, exist_ok=True)
        self.brought = _copy_missing(self.lasting, self.local)
        os.environ[INDUCTOR_ENV] = str(self.local)
        kept, here = len(_files(self.lasting)), len(_files(self.local))
        if kept:
            return (
                f"compiled kernels kept from an earlier session: {kept} files in {self.lasting} "
                f"({self.brought} copied to this machine); compiling takes seconds where they match"
            )
        if here:
            return (
                f"no compiled kernels kept in {self.lasting} yet; this machine holds {here} files compiled "
                "for earlier runs, used where they match; what this run needs is kept there for the next "
                "session"
            )
        return (
            f"no compiled kernels kept yet ({self.lasting} is empty): the first step compiles from scratch "
            "(about 20 s on a large GPU, minutes on a T4 or a CPU); they are kept there for the next session"
        )

    def keep(self) -> int:
        """Copy the local folder's files that the lasting one lacks (what this run compiled, and what other
        runs on this machine did: the files do not say which run used them); returns how many."""
        try:
            if not self.lasting.exists():
                ledger.add(self.lasting)  # CloudML's (its ledger lists it) before it exists
            self.lasting.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            log.info("compile cache: %s cannot be made (%s); the kernels are not kept", self.lasting, e)
            return 0
        return _copy_missing(self.local, self.lasting)
