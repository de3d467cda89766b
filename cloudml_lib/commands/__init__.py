"""Commands: what a user runs, `python -m cloudml_lib COMMAND` (cli.py), each on the layers below.

- runs.py       a run from start to end: training, then its end (science/finish.py); the one route for a
                run, each phase of the two-phase protocol, each fold and each sweep trial
- crossval.py   leave-one-flight-out cross-validation with baselines
- era5.py       fetch-era5: the flights' ERA5 from the Climate Data Store, with the user's key
- sweep.py      hyperparameter sweeps on Optuna that survive a disconnect: each trial asked, trained and
                told;  study.py  the study's journal on disk, its copy, its rebuilding;  space.py  the
                search space
- trialpool.py  worker processes for a sweep's trials N at once on one machine, a GPU (or cores) each
- api.py        the stated Python API for a scientist's own notebook (re-exported at the package top)
- compare.py    runs side by side;  presets.py  which preset and batch fit the GPU at hand, diagnose

May import: science, train, core, data, base.
"""
