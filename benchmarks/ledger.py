"""What the ledger's content record costs a metrics line: CloudML's append with and without it, side by side.

    python benchmarks/ledger.py      # writes benchmarks/results/ledger.json (about a minute)

The ledger (cloudml_lib/base/ledger.py) records what CloudML wrote in each file of a run folder; a file it
appends to (metrics.jsonl, train.log) by the fingerprint of what it appended: a stat and a running sha256 per
line, never the file read again. Measured: `append_text` of a realistic step record into a claimed run
folder whose ledger lists a hundred files, as the trainer appends one; `with_content` is the code as it is,
`names_only` the same code with the fingerprint switched off (what the ledger did before it recorded
contents: a name check per line). Blocks of each alternate, so the machine's drift falls on both alike.
"""

from __future__ import annotations

import json
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
from benchmarks import machine  # noqa: E402

SCRATCH = REPO / "benchmarks" / ".scratch" / "ledger"
RESULTS = REPO / "benchmarks" / "results" / "ledger.json"
LINES, BLOCKS = 500, 10  # lines per block; blocks per variant
RECORD = {
    "step": 0,
    "epoch": 1,
    "loss": 0.1234,
    "lr": 1e-3,
    "samples_s": 123.4,
    "grad_norm": 0.5,
    "time": 0.0,
}


def folder() -> Path:
    import shutil

    from cloudml_lib.base import ledger
    from cloudml_lib.base.ownership import write_marker

    shutil.rmtree(SCRATCH, ignore_errors=True)  # this script's own scratch folder
    run = SCRATCH / "run"
    run.mkdir(parents=True)
    write_marker(run, "run")
    ledger.start(run, [f"checkpoints/step-{i:08d}" for i in range(100)])
    return run


def block(path: Path) -> float:
    """Seconds per line over one block of appends."""
    from cloudml_lib.base.outputs import append_text

    t0 = time.perf_counter()
    for i in range(LINES):
        append_text(path, json.dumps(dict(RECORD, step=i)) + "\n")
    return (time.perf_counter() - t0) / LINES


def main() -> None:
    from cloudml_lib.base import ledger

    run = folder()
    real = ledger.appending, ledger.appended, ledger.differs
    off = (lambda path: None, lambda path, data, end=None: None, lambda store, rel, rec: None)
    seconds: dict[str, list[float]] = {"with_content": [], "names_only": []}
    for n in range(BLOCKS):
        for name in ("with_content", "names_only") if n % 2 == 0 else ("names_only", "with_content"):
            ledger.appending, ledger.appended, ledger.differs = real if name == "with_content" else off
            seconds[name].append(block(run / f"metrics-{name}.jsonl"))
            ledger.flush()
    ledger.appending, ledger.appended, ledger.differs = real
    medians = {k: statistics.median(v) * 1e3 for k, v in seconds.items()}
    out = {
        "machine": machine(),
        "lines_per_block": LINES,
        "blocks": BLOCKS,
        "ms_per_line_median": medians,
        "ms_per_line_blocks": {k: [s * 1e3 for s in v] for k, v in seconds.items()},
        "with_content_over_names_only": medians["with_content"] / medians["names_only"],
    }
    RESULTS.write_text(json.dumps(out, indent=1) + "\n")
    print(json.dumps({k: out[k] for k in ("ms_per_line_median", "with_content_over_names_only")}, indent=1))


if __name__ == "__main__":
    main()
