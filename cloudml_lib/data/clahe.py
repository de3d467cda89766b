"""scikit-image's CLAHE (`skimage.exposure.equalize_adapthist`, 2-D float frames) in batched torch.

It repeats scikit-image 0.26's algorithm step by step, with the same integer and floating-point operations
in the same order, so that its output is scikit-image's bit for bit (measured on the CPU: max abs
difference 0 on random, smooth, coarse and narrow-range frames of 2 x 3 to 440 x 640 pixels, sizes not
divisible by 8 included, constant frames, and the demo flights' frames; tests/test_clahe.py). The steps:
1. `img_as_uint`: x -> rint(float32(x * 65535)) as uint16; then `rescale_intensity` to 0 .. 2**14 - 1
   in float64 and np.round (half to even);
2. reflect padding: k // 2 before each side, (k - s % k) % k + ceil(k / 2) after (k: the kernel, by
   default max(1, s // 8) of each side s);
3. values to bins: v // (1 + 2**14 // nbins);
4. a histogram per k x k tile of the padded frame's inner part (offset k // 2), clipped at
   max(1, int(clip_limit * k * k)) and its excess redistributed as scikit-image's `clip_histogram` does
   (an even share, then the rest bin by bin, strided, until none is left);
5. the mapping: int(min(2**14 - 1, cumsum * ((2**14 - 1) / (k * k)))) in float64;
6. bilinear interpolation between the four neighbouring tiles' mappings: each term float32(mapping x
   weight) (a float64 product) added to a float32 sum in scikit-image's order, then truncated to an
   integer (scikit-image's cast to uint16);
7. `rescale_intensity` of that integer image (as float32) to [0, 1] by its own minimum and maximum.

On a GPU the same operations run in the same precision (IEEE float32 and float64, correctly rounded
division, no fused or reordered arithmetic: each step is its own elementwise kernel), so the frames are
expected to be scikit-image's there too. That is not measured (no CUDA GPU where this was written); the one
place a rounding difference could show is step 6's truncation: one level, 1 / 16383 (6.1e-5) of the output.

Memory: frames go through in chunks of `chunk` frames; a chunk holds a few int64 and float64 copies of its
frames (~40 bytes a pixel) and its tiles' histograms.

The decision this supports (preprocess.py): frames equalised here are the same reading as scikit-image's:
their z-score is computed by the same numpy code, so the float16 frames a cache stores are identical (0
differing values in the tiny demo flight's cache: tests/test_clahe.py), a cache built either way has the
same key, and it serves a model trained on either.
"""

from __future__ import annotations

import math

import numpy as np
import torch

GRAY_LEVELS = 2**14  # scikit-image's NR_OF_GRAY: the internal intensity resolution
NBINS = 256
CHUNK_FRAMES = 16  # frames equalised at once: ~40 bytes a pixel each (440 x 640: ~180 MB)


def kernel_size(shape: tuple[int, int]) -> tuple[int, int]:
    """scikit-image's default kernel: 1/8 of each side (at least 1)."""
    return max(shape[0] // 8, 1), max(shape[1] // 8, 1)


def equalize_adapthist(x: torch.Tensor, clip_limit: float = 0.01, chunk: int = CHUNK_FRAMES) -> torch.Tensor:
    """(n, H, W) float frames in [0, 1] -> (n, H, W) float32 in [0, 1], as scikit-image's
    `equalize_adapthist(frame, clip_limit=clip_limit)` of each frame, on x's device."""
    if x.ndim != 3:
        raise ValueError(f"frames of shape (n, H, W) expected, not {tuple(x.shape)}")
    out = torch.empty(x.shape, dtype=torch.float32, device=x.device)
    for i in range(0, x.shape[0], chunk):
        out[i : i + chunk] = _equalise(x[i : i + chunk].to(torch.float32), clip_limit)
    return out


def _equalise(x: torch.Tensor, clip_limit: float) -> torch.Tensor:
    n, h, w = x.shape
    k = kernel_size((h, w))
    levels = to_levels(x)  # (n, H, W) int64, 0 .. GRAY_LEVELS - 1
    padded, starts = reflect_pad(levels, k)
    bins = padded // (1 + GRAY_LEVELS // NBINS)
    maps = tile_mappings(bins, k, clip_limit)  # (n, K0, K1, NBINS) int64
    inner = bins[:, starts[0] : starts[0] + h, starts[1] : starts[1] + w]
    result = interpolate(inner, maps, k, starts)  # (n, H, W) int64
    return rescale_unit(result.to(torch.float32))


def to_levels(x: torch.Tensor) -> torch.Tensor:
    """img_as_uint, then rescale_intensity to 0 .. GRAY_LEVELS - 1 and np.round."""
    u = torch.round(x * np.float32(65535)).clamp_(0, 65535).to(torch.float64)  # float32 product, as skimage
    lo = u.amin(dim=(1, 2), keepdim=True)
    hi = u.amax(dim=(1, 2), keepdim=True)
    span = torch.where(hi > lo, hi - lo, torch.ones_like(hi))
    scaled = (u - lo) / span * float(GRAY_LEVELS - 1)
    flat = u.clamp(0, GRAY_LEVELS - 1)  # a constant frame: rescale_intensity clips it to the output range
    return torch.round(torch.where(hi > lo, scaled, flat)).to(torch.int64)


def reflect_pad(x: torch.Tensor, k: tuple[int, int]) -> tuple[torch.Tensor, tuple[int, int]]:
    """np.pad(mode="reflect") with scikit-image's widths; also the widths before each side."""
    starts = (k[0] // 2, k[1] // 2)
    rows = _reflect_index(x.shape[1], k[0], x.device)
    cols = _reflect_index(x.shape[2], k[1], x.device)
    return x[:, rows][:, :, cols], starts


def _reflect_index(s: int, k: int, device) -> torch.Tensor:
    before, after = k // 2, (k - s % k) % k + math.ceil(k / 2)
    i = torch.arange(-before, s + after, device=device)
    if s == 1:
        return torch.zeros_like(i)
    period = 2 * (s - 1)  # reflect without repeating the edge, as often as needed
    i = torch.remainder(i, period)
    return torch.where(i >= s, period - i, i)


def tile_mappings(bins: torch.Tensor, k: tuple[int, int], clip_limit: float) -> torch.Tensor:
    """Each tile's clipped histogram's cumulative mapping to 0 .. GRAY_LEVELS - 1: (n, K0, K1, NBINS)."""
    n = bins.shape[0]
    counts = (bins.shape[1] // k[0] - 1, bins.shape[2] // k[1] - 1)  # tiles per side
    tiles = bins[:, k[0] // 2 : k[0] // 2 + counts[0] * k[0], k[1] // 2 : k[1] // 2 + counts[1] * k[1]]
    tiles = tiles.reshape(n, counts[0], k[0], counts[1], k[1]).permute(0, 1, 3, 2, 4)
    tiles = tiles.reshape(n * counts[0] * counts[1], k[0] * k[1])
    offsets = torch.arange(tiles.shape[0], device=bins.device)[:, None] * NBINS
    hist = torch.bincount((tiles + offsets).reshape(-1), minlength=tiles.shape[0] * NBINS)
    hist = hist.reshape(tiles.shape[0], NBINS)
    elements = k[0] * k[1]
    limit = int(np.clip(clip_limit * elements, 1, None)) if clip_limit > 0 else elements
    hist = clip_histograms(hist, limit)
    mapping = torch.cumsum(hist, dim=-1).to(torch.float64) * ((GRAY_LEVELS - 1) / elements)
    mapping = mapping.clamp_(max=GRAY_LEVELS - 1).to(torch.int64)
    return mapping.reshape(n, counts[0], counts[1], NBINS)


def clip_histograms(hist: torch.Tensor, limit: int) -> torch.Tensor:
    """scikit-image's clip_histogram on each row of (m, nbins) int64 counts."""
    over = hist > limit
    excess = torch.where(over, hist - limit, torch.zeros_like(hist)).sum(dim=1)  # (m,)
    hist = torch.where(over, torch.full_like(hist, limit), hist)
    increment = excess // hist.shape[1]
    upper = (limit - increment)[:, None]
    low = hist < upper
    excess = excess - low.sum(dim=1) * increment
    hist = hist + low * increment[:, None]
    mid = (hist >= upper) & (hist < limit)
    excess = excess + torch.where(mid, hist - limit, torch.zeros_like(hist)).sum(dim=1)
    hist = torch.where(mid, torch.full_like(hist, limit), hist)
    return _redistribute(hist, excess, limit)


def _redistribute(hist: torch.Tensor, excess: torch.Tensor, limit: int) -> torch.Tensor:
    """The rest of the excess, one count at a time: in each pass, for index 0, 1, ..., every step-th bin from
    index on that is under the limit gets one (step: the bins under the limit // the excess left), until a
    histogram has none left (it may overshoot, as scikit-image's does) or a pass changes nothing."""
    nbins = hist.shape[1]
    position = torch.arange(nbins, device=hist.device)
    while bool((excess > 0).any()):
        before = excess.clone()
        active = excess > 0
        for index in range(nbins):
            under = hist < limit
            step = torch.clamp(under.sum(dim=1) // torch.clamp(excess, min=1), min=1)[:, None]
            hit = under & (position >= index) & ((position - index) % step == 0) & active[:, None]
            hist = hist + hit
            excess = excess - hit.sum(dim=1)
            active = active & (excess > 0)
            if not bool(active.any()):
                break
        stuck = excess == before
        if bool(stuck.all()):
            break
        excess = torch.where(stuck, torch.zeros_like(excess), excess)  # that histogram's loop ended
    return hist


def interpolate(inner: torch.Tensor, maps: torch.Tensor, k: tuple[int, int], starts: tuple[int, int]):
    """Each pixel's value: the four neighbouring tiles' mappings of its bin, weighted by its place between the
    tiles' centres, summed in float32 in scikit-image's order and truncated: (n, H, W) int64."""
    n, h, w = inner.shape
    counts = maps.shape[1:3]
    # the mappings padded by one tile at each side (edge), as scikit-image's map_array
    rows = torch.arange(h, device=inner.device) + starts[0]
    cols = torch.arange(w, device=inner.device) + starts[1]
    row_weight = (rows % k[0]).to(torch.float64) / k[0]  # (H,)
    col_weight = (cols % k[1]).to(torch.float64) / k[1]  # (W,)
    frame = torch.arange(n, device=inner.device)[:, None, None] * (counts[0] * counts[1] * NBINS)
    flat = maps.to(torch.float64).reshape(-1)  # whole numbers: exact in float64, as scikit-image's product
    result = torch.zeros(inner.shape, dtype=torch.float32, device=inner.device)
    for e0, e1 in ((0, 0), (0, 1), (1, 0), (1, 1)):
        tile_row = torch.clamp(rows // k[0] + e0 - 1, 0, counts[0] - 1)  # (H,)
        tile_col = torch.clamp(cols // k[1] + e1 - 1, 0, counts[1] - 1)  # (W,)
        tile = (tile_row[:, None] * counts[1] + tile_col[None, :]) * NBINS  # (H, W)
        mapped = torch.take(flat, (frame + tile) + inner)  # (n, H, W) float64
        wr = row_weight if e0 else 1 - row_weight
        wc = col_weight if e1 else 1 - col_weight
        result += (mapped * (wc[None, :] * wr[:, None])).to(torch.float32)
    return result.to(torch.int64)  # scikit-image's cast to the image's uint16: truncation


def rescale_unit(x: torch.Tensor) -> torch.Tensor:
    """rescale_intensity of float32 images to [0, 1] by their own range (a constant one: clipped to it)."""
    lo = x.amin(dim=(1, 2), keepdim=True)
    hi = x.amax(dim=(1, 2), keepdim=True)
    span = torch.where(hi > lo, hi - lo, torch.ones_like(hi))
    return torch.where(hi > lo, (x - lo) / span, x.clamp(0, 1))
