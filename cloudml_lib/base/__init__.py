"""Base: what every layer uses and that knows nothing of runs, models or flights.

- config.py     the run configuration: dataclasses, YAML loading, `--set` overrides, checks, resume rules
- errors.py     the exceptions a user can cause, each naming the key, file or value; explained OS errors
- runfiles.py   the one reader of every JSON file a run folder holds, each read as untrusted;  shapes.py
                the shape, type and range a structured file must have, and its one JSON reader
- files.py      files opened without blocking and checked on the descriptor (a regular file, never a FIFO)
- store.py      where a claimed folder lies (a folder here, or a bucket's prefix): one storage interface
- ownership.py  which folders are CloudML's: its .cloudml marker, or an earlier release's files that verify
- ledger.py     within such a folder, what CloudML created (.cloudml-files): all it may replace or delete
- bucket.py     a folder in a bucket (an fsspec URL: gs://, s3://): its scheme's package, and its storage
                for the same rules as a folder's (`Prefix`, a store)
- layout.py     a run folder's layout (`RunLayout`): every file and folder name a run writes, once
- outputs.py    atomic writes, appends that never go through a link, folders CloudML may write into
- yamlfile.py   YAML read safely;  logs.py  the package's log (screen and train.log)
- tables.py     Markdown and text tables;  resources.py  files the installed package carries
- faults.py     fault injection for the tests (CLOUDML_KILL_AT);  liveness.py  is a process alive

May import: nothing of cloudml_lib outside base (pyproject.toml's import-linter contracts check it).
"""
