"""`python -m cloudml_lib`: stop signals are trapped before anything else is imported, so that a stop
at any moment ends with exit status 130 (see cli.py). A process of a torchrun job ends without the
interpreter's finalization, where torch's threads can abort it (distributed.exit_without_finalizing)."""

import os
import signal
import sys


def _stop(signum, frame):
    raise KeyboardInterrupt(signal.Signals(signum).name)


def _in_a_job() -> bool:
    """Has this process joined a torchrun job's process group? (torch is imported only where it has)"""
    job = sys.modules.get("cloudml_lib.core.machine.distributed")
    return job is not None and job.joined()


signal.signal(signal.SIGTERM, _stop)
try:
    if os.environ.get("CLOUDML_KILL_AT"):  # the tests' fault injection (faults.py)
        from cloudml_lib.base.faults import at_start

        at_start()
    from cloudml_lib.commands.cli import main

    code = main()
except KeyboardInterrupt as e:  # a stop while the library was still being imported
    print(
        f"interrupted ({str(e) or 'SIGINT'}) before anything was started. Run the same command again.",
        file=sys.stderr,
    )
    code = 130
except Exception:  # an unexpected error: its traceback, as Python prints it, and exit status 1
    if not _in_a_job():
        raise
    import traceback

    traceback.print_exc()
    code = 1
if _in_a_job():
    sys.modules["cloudml_lib.core.machine.distributed"].exit_without_finalizing(code)
sys.exit(code)
