"""Core: the network, the machine a run trains on, and the run folder, one package each.

- network/   the model, compiling it, running it over many windows (with recovery), its metrics
- machine/   the device and precision, memory (estimate, probe), timing, several processes
- run/       the run folder's kinds and claim, checkpoints, progress, resume point, state, lock, record

Inside core, each imports only those listed before it (import-linter: "core's layers"): the network knows no
machine bookkeeping and no run folder; the machine may use the network; the run uses both.
May import: data, base.
"""
