"""The CPU implementation of ``fxbackend.weights.fingerprint``: the fingerprint every value derived
from a weight is checked with on every call (a weight's channels-last copy, a cast, an int8
quantized weight), so its cost is paid per call.

Maths (``fxbackend/weights.py``): the 32-bit words of the bytes a tensor spans (the 0-3
trailing bytes as one more word) in rows of 16 lanes; per lane the sum ``A`` of its words and
the sum ``B`` of the running sums of ``A`` (Fletcher's two sums, mod 2**32), then both folded
over the lanes with odd multipliers.  The row loop is two additions per word.  Rows are
summed in parallel chunks (``prange``), each chunk's ``B`` shifted by its ``A`` times the rows
after it, which gives ``torch_fingerprint``'s value for every tensor.  A tensor of one chunk
(up to :data:`CHUNK` words) is hashed on the calling thread: a parallel launch costs more
than the loop.
"""
from __future__ import annotations

import numpy as np
import torch

from fxbackend import weights as _weights

from . import _numba
from .rope import _flat, _set_threads

prange = range  # numba.prange once the kernels are built (_numba.once)

#: words per parallel chunk (a multiple of the 16 lanes)
CHUNK = 1 << 16
_LANES = 16
_M32 = np.uint64(0xFFFFFFFF)


def _rows(words, r0, r1, a, b):  # pragma: no cover - compiled by numba
    """Rows ``r0 .. r1-1`` of 16 words: ``a[l] += w``, then ``b[l] += a[l]``, per lane."""
    for r in range(r0, r1):
        base = r * 16
        for lane in range(16):
            a[lane] = np.uint32(a[lane] + words[base + lane])
            b[lane] = np.uint32(b[lane] + a[lane])


def _fold(a_parts, b_parts, rows_per_chunk, full, words, extra):  # pragma: no cover
    """The chunks' sums combined (a chunk's ``B`` shifted by its ``A`` times the rows after
    it), the last, partial row added (weight 1), the lanes folded: ``(h1, h2)``."""
    rest = words.shape[0] - full * 16 + extra.shape[0]
    total_rows = full + (1 if rest > 0 else 0)
    lane_a = np.zeros(16, np.uint64)
    lane_b = np.zeros(16, np.uint64)
    for c in range(a_parts.shape[0]):
        after = np.uint64(total_rows - min((c + 1) * rows_per_chunk, full))
        for lane in range(16):
            pa = np.uint64(a_parts[c, lane])
            lane_a[lane] = (lane_a[lane] + pa) & _M32
            lane_b[lane] = (lane_b[lane] + np.uint64(b_parts[c, lane]) + ((after * pa) & _M32)) \
                & _M32
    for j in range(full * 16, words.shape[0] + extra.shape[0]):
        w = np.uint64(words[j]) if j < words.shape[0] else np.uint64(extra[j - words.shape[0]])
        lane = j - full * 16
        lane_a[lane] = (lane_a[lane] + w) & _M32
        lane_b[lane] = (lane_b[lane] + w) & _M32
    h1 = np.uint64(0)
    h2 = np.uint64(0)
    for lane in range(16):
        m1 = np.uint64(2 * lane + 1)
        m2 = (np.uint64(lane) * np.uint64(0x9E3779B9) & _M32) | np.uint64(1)
        h1 = (h1 + m1 * lane_a[lane]) & _M32
        h2 = (h2 + ((m2 * lane_b[lane]) & _M32)) & _M32
    return h1, h2


def _hash(words, extra, rows_per_chunk):  # pragma: no cover - compiled by numba
    full = words.shape[0] // 16
    nchunks = (full + rows_per_chunk - 1) // rows_per_chunk
    a_parts = np.zeros((nchunks, 16), np.uint32)
    b_parts = np.zeros((nchunks, 16), np.uint32)
    for c in prange(nchunks):
        _rows(words, c * rows_per_chunk, min((c + 1) * rows_per_chunk, full), a_parts[c],
              b_parts[c])
    return _fold(a_parts, b_parts, rows_per_chunk, full, words, extra)


def _hash_serial(words, extra, rows_per_chunk):  # pragma: no cover - compiled by numba
    """:func:`_hash` on the calling thread (one chunk: no parallel launch)."""
    full = words.shape[0] // 16
    a_part = np.zeros((1, 16), np.uint32)
    b_part = np.zeros((1, 16), np.uint32)
    _rows(words, 0, full, a_part[0], b_part[0])
    return _fold(a_part, b_part, max(full, 1), full, words, extra)


def _build(numba):
    _numba.inline(_rows, _fold)
    return _numba.njit(_hash), _numba.njit(_hash_serial, parallel=False)


_jit = _numba.once(globals(), _build)


def fingerprint_cpu(t: torch.Tensor) -> int:
    """``fxbackend.weights.fingerprint`` of a CPU tensor (in parallel on numba's threads when it
    spans more than one chunk)."""
    if t.numel() == 0:
        return 0
    span = 1 + sum((s - 1) * st for s, st in zip(t.shape, t.stride()))
    arr = _flat(t, span).view(np.uint8)
    n4 = arr.shape[0] // 4 * 4
    tail = arr[n4:].tobytes()
    extra = np.array([int.from_bytes(tail, "little")] if tail else [], np.uint32)
    parallel, serial = _jit()
    words = arr[:n4].view(np.uint32)
    if words.shape[0] > CHUNK:
        _set_threads()
        h1, h2 = parallel(words, extra, CHUNK // _LANES)
    else:
        h1, h2 = serial(words, extra, CHUNK // _LANES)
    return (int(h1) << 32) | int(h2)


_weights.register_fingerprint("cpu", fingerprint_cpu)
