"""Core: a run's parts that are neither its data nor its loop.

- model.py        the network (frame encoder, temporal pooling, FiLM on the angles, heads), named outputs
- checkpoint.py   what a checkpoint holds and how it is committed and verified
- progress.py     where a run stands in its training (`Progress`: plain, read by all that reads a checkpoint)
- rundir.py       a run folder over time: leftovers, the resume point, metrics.jsonl, where it stands
                  (`run_state`: the one definition of stopped, trained, finished, failed)
- runlock.py      who may write into a run folder;  events.py  its TensorBoard record
- provenance.py   what a result was made from (the run's record)
- device.py       the device and precision, the machine's memory;  memory.py / estimate.py  the memory
                  model (measured by the batch probe, computed from the model on fake tensors)
- distributed.py  several processes (torchrun);  compile.py  torch.compile from outside;
                  recovery.py  out-of-memory and compile failures recovered from
- timing.py       how long a run will take (an earlier run's measurement, timed steps, or the FLOPs) and
                  what its epochs took (run.json)
- inference.py    a model over many windows (each frame encoded once) and the Evaluator;
                  metrics.py  the metrics of heights and cloud flags, the same during and after training

May import: data, base.
"""
