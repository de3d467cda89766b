"""Data: ER-2 flight files -> preprocessing cache -> training samples.

- er2.py, cpl.py  the IR, navigation and lidar files read and checked; labels matched to frames
- flights.py      flights found in a folder by their file names;  synthetic.py  the demo flights, written in
                  the real file layout
- preprocess.py   a frame's preprocessing (crop, CLAHE) on every core or the GPU
- cache.py, cachefiles.py  the memory-mapped cache, built once, verified, copied to Drive
- dataset.py      windows of T frames, the scalers, the batch sampler;  hashing.py  file checksums

May import: base.
"""
