"""Science: what reads a trained run.

- finish.py     the end of a run, a stage of its own after training: the cloud probe fitted and the
                intervals calibrated once, on data that are not the test flights, then the test flights
                scored once, the report
- evaluate.py   the one route from best.pt to the test flights' report (the end and `evaluate` take it);
                skill.py  its numbers per flight, with their spread and by height range
- baselines.py  the height's baselines (the training mean, a linear model and trees on the frame's
                brightness statistics; with ERA5 two physical retrievals and trees on the atmosphere), the
                best of them, the network's skill against it, whether the frames add to the atmosphere
- report.py     report.md and the report as text (the log's tables), the verdicts per flight, the protocol
                in words;  plots.py  the figures
- predict.py    cloud base height along whole flights: each frame's inputs, the model on them, the files
                written;  flagging.py  each frame's cloud flag, height qc and interval;  flightfile.py
                the NetCDF, CSV and plots;  products.py  their variables
- intervals.py  prediction intervals (split conformal);  clouds.py  cloud / no-cloud baselines, the probe
- adapt.py      a new flight's first N labels: the network's head fine-tuned, the baselines and intervals
                given the same labels, all scored only after a gap (crossval's curve, the API's `adapt`)
- export.py     a run's best model as files a colleague loads without CloudML (torch.export, safetensors,
                the inputs' preprocessing as JSON, a model card)

May import: core, data, base (training never imports science: the two are independent stages).
"""
