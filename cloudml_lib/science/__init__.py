"""Science: what reads a trained run.

- finish.py     the end of a run, a stage of its own after training: the best model on the held-out
                flights, the cloud probe and the intervals fitted once, the report
- evaluate.py   the one route from best.pt to the held-out report (the end and `evaluate` take it)
- predict.py    cloud base height along whole flights (NetCDF, CSV, figures); products.py its variables
- intervals.py  prediction intervals (split conformal);  clouds.py  cloud / no-cloud baselines, the probe
- report.py     report.md and the verdict;  plots.py  the figures

May import: core, data, base (training never imports science: the two are independent stages).
"""
