"""A NaN or infinite loss in training: the step is skipped (the weights never see it), counted and said; the
first one checks every preprocessing cache against the checksums recorded at its build (bit rot in the cache,
not the optimisation, is then named); train.max_nonfinite_steps in a row stop the run with what to change.
"""

from __future__ import annotations

import logging
import time

from cloudml_lib.base.errors import CloudMLError, DataError
from cloudml_lib.data.cachefiles import verify_cache

log = logging.getLogger(__name__)


def count_nonfinite_step(st, train, caches: list, caches_checked: bool) -> bool:
    """A skipped NaN/inf step counted and said; the caches checked the first time (returns True once they
    were); training stopped after train.max_nonfinite_steps in a row."""
    st.nonfinite_in_a_row += 1
    st.nonfinite_total += 1
    log.warning(
        "Non-finite loss at step %d (epoch %d, batch %d): step skipped, weights unchanged (%d in a row, "
        "%d in all).",
        st.step,
        st.epoch + 1,
        st.batch,
        st.nonfinite_in_a_row,
        st.nonfinite_total,
    )
    if not caches_checked:
        check_caches_intact(caches)
    if st.nonfinite_in_a_row >= train.max_nonfinite_steps:
        raise CloudMLError(
            f"training stopped: {train.max_nonfinite_steps} optimizer steps in a row had a NaN or infinite "
            "loss "
            f"(train.max_nonfinite_steps). The preprocessing cache was checked against its checksums and is "
            "intact, so the data did not change; the weights were never updated with those steps, and "
            "best.pt "
            f"and the checkpoints hold finite models. Lower train.learning_rate (now "
            f"{train.learning_rate}), then run the same command to resume from the last checkpoint."
        )
    return True


def check_caches_intact(caches: list) -> None:
    """A NaN loss can come from bit rot in the cache rather than the optimisation: every cache is
    checked against the checksum recorded when it was built (same files on every process, so all
    take the same decision)."""
    t0 = time.time()
    problems = [p for p in map(verify_cache, caches) if p]
    if problems:
        raise DataError(
            "NaN/inf losses: " + "; ".join(problems) + ". Delete the named cache folder(s): they are "
            "rebuilt from the IR files at the next start. Then run the same command again: training "
            "resumes from the last checkpoint, whose weights are finite."
        )
    log.info(
        "The preprocessing cache matches its checksums (checked in %.1f s): the data is intact",
        time.time() - t0,
    )
