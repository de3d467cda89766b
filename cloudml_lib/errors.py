"""Exceptions a user can cause. The CLI prints these as one short message and exits with status 2."""


class CloudMLError(Exception):
    """A problem the user can fix (config, data, paths); the message says what and how."""


class ConfigError(CloudMLError):
    """A config file or override is invalid."""


class DataError(CloudMLError):
    """A flight file, key or value is missing or unusable."""


def in_notebook_session() -> bool:
    """This process is a notebook's kernel, or a command a notebook started (colab/live.py sets
    CLOUDML_PARENT_PID): what the user types goes into a notebook cell."""
    import os
    import sys

    if os.environ.get("CLOUDML_PARENT_PID"):
        return True
    ipython = sys.modules.get("IPython")
    try:
        return ipython is not None and ipython.get_ipython() is not None
    except AttributeError:
        return False


def install_command(requirement: str) -> str:
    """The command that installs an optional package where the user is: `%pip install ...` in a notebook
    cell (it installs into the kernel's own environment), `pip install ...` in a terminal."""
    quoted = f"'{requirement}'" if any(c in requirement for c in "<>=!") else requirement
    return f"{'%pip' if in_notebook_session() else 'pip'} install {quoted}"
