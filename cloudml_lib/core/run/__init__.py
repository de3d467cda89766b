"""The run folder: its names, kinds and claim, its checkpoints, progress and state, its record.

- folder.py       `RunFolder`: the run folder as the object the layers above take (a method for each thing
                  done with it: check its kind, claim, lock, resume point, state, readers, run.json)
- runfolder.py    its kinds (run, cross-validation, sweep) and their adoption, leftovers, the metrics file
- checkpoint.py   what a checkpoint holds and how it is committed, verified and pruned
- progress.py     where a run stands in its training (`Progress`: plain, read by all that reads a checkpoint)
- resume.py       the resume point, and what a resumed run may change
- status.py       where a run stands (`run_state`: the one definition of stopped, trained, finished, failed)
- runlock.py      who may write into a run folder (RunFolder.lock), and whether a live process holds it
- events.py       its TensorBoard record
- provenance.py   what a result was made from (the run's record)

The file and folder names themselves are written once, in base/layout.py (`RunLayout`), so that the layers
below (the ledger, the readers of run files) name them too. May import: the machine, the network, data, base.
"""
