"""`python -m cloudml_lib`: stop signals are trapped before anything else is imported, so that a stop
at any moment ends with exit status 130 (see cli.py)."""

import os
import signal
import sys


def _stop(signum, frame):
    raise KeyboardInterrupt(signal.Signals(signum).name)


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
sys.exit(code)
