"""The machine a run trains on: its device and precision, its memory, its processes, its speed.

- device.py       the device and precision, the machine's memory
- memory.py       the memory model and the one synthetic training step (the estimate, the batch probe and
                  the timing all measure this step)
- estimate.py     a run's memory counted on fake tensors, before anything is allocated
- kept_estimates.py  the estimates counted once per machine, torch and code, read back by later processes
- timing.py       how long a run will take (an earlier run's measurement, timed steps, or the FLOPs)
- determinism.py  train.deterministic: the same numbers on a GPU across a resume, at some speed
- distributed.py  several processes (torchrun): ranks, the process group, who goes first

May import: the network (the synthetic step builds it), data, base; nothing of the run folder.
"""
