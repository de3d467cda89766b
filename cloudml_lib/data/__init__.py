"""Data: ER-2 flight files -> preprocessing cache -> training samples.

- er2.py          a flight's files by role, and the IR file's frame times and shape
- hdf5.py         HDF5 values read with messages naming the flight, the file and the key
- times.py        dates and times, epoch seconds, each lidar profile matched to its frame
- navigation.py   the nav per frame (the users' HDF rows, or public ICARTT text checked before use);
                  ict.py  our reader of ICARTT 1001 text;  sun.py  where the sun is (NOAA's equations),
                  and whether a nav file's angles agree
- cpl.py          the CPL layers to one label per frame: layer, filters, matching, match rate, cloud classes
- flights.py      flights found in a folder by their file names
- era5.py         ERA5 reanalysis as the Climate Data Store serves it (both NetCDF layouts), interpolated
                  to each frame;  atmosphere.py  the predictors derived from it (LCL, LTS, EIS, ...);
                  era5_requests.py  the box and hours of a flight, as requests to the Climate Data Store;
                  predictors.py  a run's flights' predictors at each labelled frame (data.atmosphere)
- synthetic.py    the demo flights, written in the real file layout (only where a command starts:
                  import-linter);  demo.py  their names and test flight, all a run needs to know of them;
                  demo_era5.py  the ERA5 files beside them (generator 4), drawn around their atmosphere
- preprocess.py   a frame's preprocessing (crop, CLAHE) and its radiometric statistics, on every core or
                  the GPU;  clahe.py  scikit-image's CLAHE in batched torch, the same frames
- cache.py, cachefiles.py  the memory-mapped cache, built once, verified, copied to Drive
- splits.py       which samples play which role: test flights (nothing chosen on them), validation data
                  (drawn from the training flights by a stated rule), the part trained on
- dataset.py      windows of T frames, the scalers, the batch sampler;  hashing.py  file checksums
- domain.py       the inputs of the samples a model was trained on, and whether a new frame's lie among
                  them (ranges and a Mahalanobis distance): where a flight's heights extrapolate

May import: base.
"""
