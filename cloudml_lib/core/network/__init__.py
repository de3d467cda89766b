"""The network and running it: what it is, how it is compiled, how it goes over many windows.

- model.py        the network (frame encoder, temporal pooling, FiLM on the angles, heads), named outputs
- compile.py      torch.compile from outside, and the plain module inside any wrapper
- compile_cache.py  the compiled kernels kept in a lasting folder, for the next machine
- recovery.py     out-of-memory and compile failures recovered from (a smaller batch, the eager model)
- inference.py    a model over many windows (each frame encoded once) and the Evaluator
- metrics.py      the metrics of heights and cloud flags, the same during and after training

May import: data, base; nothing of the machine or the run folder (import-linter: core's layers). The
model, compile.py, recovery.py and metrics.py read no data at all: the network is importable alone (a
contract).
"""
