"""Core: the network, the run folder and the machine a run trains on, each in its own modules.

The network
- model.py        the network (frame encoder, temporal pooling, FiLM on the angles, heads), named outputs
- compile.py      torch.compile from outside;  recovery.py  out-of-memory and compile failures recovered from
- inference.py    a model over many windows (each frame encoded once) and the Evaluator;
                  metrics.py  the metrics of heights and cloud flags, the same during and after training
The run folder
- runfolder.py    its names, its kinds (run, cross-validation, sweep) and their adoption, leftovers, metrics
- checkpoint.py   what a checkpoint holds and how it is committed and verified
- progress.py     where a run stands in its training (`Progress`: plain, read by all that reads a checkpoint)
- resume.py       the resume point, and what a resumed run may change
- status.py       where a run stands (`run_state`: the one definition of stopped, trained, finished, failed)
- runlock.py      who may write into a run folder;  events.py  its TensorBoard record
- provenance.py   what a result was made from (the run's record)
The machine
- device.py       the device and precision, the machine's memory;  memory.py / estimate.py  the memory
                  model and the one synthetic step (measured by the batch probe, counted on fake tensors)
- distributed.py  several processes (torchrun)
- timing.py       how long a run will take (an earlier run's measurement, timed steps, or the FLOPs) and
                  what its epochs took (run.json)

May import: data, base.
"""
