"""The CPU implementation of ``fxbackend.weights.fingerprint``: the fingerprint every value derived
from a weight is checked with on every call (a weight's channels-last copy, a cast, an int8
quantized weight), so its cost is paid per call.

Maths (``fxbackend/weights.py``): over the 32-bit words ``w[i]`` of the bytes a tensor spans,

    h1 = sum_i w[i] * (2i + 1)                         mod 2**32
    h2 = sum_i (w[i] ^ (w[i] >> 16)) * (i * 0x9E3779B9 | 1)  mod 2**32

plus the 0-3 trailing bytes as one more word; the result is ``(h1 << 32) | h2``.  Both sums are
linear in the position, so chunks are summed in parallel (``prange``) and their partial sums
added: the same value as ``torch_fingerprint`` for every tensor.  A tensor of one chunk (a bias,
a norm's weight) is summed on the calling thread, without a parallel launch: 5.9 against 12.7 us
for 384 float32 words, 8.4 against 17 us for 24576, warm, on 2 threads of an AVX2-only EPYC
(and the partial sums are added in Python: numpy's reductions of a few values cost 1.9 us).
The loop is a vectorisable multiply-add over uint32 lanes (AVX2's ``vpmulld``, two per word):
20-47 GB/s on 2 threads of an AMD EPYC with AVX-512 for 0.5-38 MB float32 weights, about as fast
as a copy of the same bytes; 12 GB/s on 2 threads of a Xeon with AMX (28 tensors of 0.25-8 MB),
where a plain sum of the same words runs at 23 GB/s: there the multiplies bound it.
"""
from __future__ import annotations

import numpy as np
import torch

from fxbackend import weights as _weights

from . import _numba
from .rope import _flat, _set_threads

prange = range  # numba.prange once the kernels are built (_numba.once)

#: words per parallel chunk
CHUNK = 1 << 16


def _partials(words, chunk, h1s, h2s):  # pragma: no cover - compiled by numba
    # the per-chunk sums into h1s / h2s (one slot per chunk of ``chunk`` words, the caller's
    # count), added up by the caller: a sum of the arrays here (numba's reduction) tripled the
    # cold compile (1.3 s against ~0.4 s)
    n = words.shape[0]
    for c in prange(h1s.shape[0]):
        _chunk_sums(words, c * chunk, min(c * chunk + chunk, n), h1s, h2s, c)


def _serial(words, h1s, h2s):  # pragma: no cover - compiled by numba
    # all of ``words`` as one chunk, on the calling thread: a tensor of at most ``CHUNK`` words
    # (a bias, a norm's weight) needs no parallel launch, which cost 3 us warm and 30-45 us
    # after other work (2 threads of an AVX2-only EPYC) against 0.6 us here for 384 words
    _chunk_sums(words, 0, words.shape[0], h1s, h2s, 0)


def _chunk_sums(words, lo, hi, h1s, h2s, c):  # pragma: no cover - inlined by numba
    # h1s[c] / h2s[c]: the sums of words[lo:hi] at their positions
    h1 = np.uint32(0)
    h2 = np.uint32(0)
    # the chunk as a slice of its own, with a uint32 position advanced per word: numba
    # widens uint32 arithmetic to 64 bits, and truncating every result (here and below)
    # lets LLVM keep 32-bit lanes (vpmulld); indexing ``words`` by the int64 loop variable
    # and truncating that per word instead ran about 5x slower (2 threads
    # of an AMD EPYC with AVX-512, a 4.7 MB tensor: 9 against 44 GB/s, the same with AVX2)
    part = words[lo:hi]
    # the position terms as induction variables: q = 2u + 1 advances by 2 and u * M by M
    # per word (mod 2**32: the same values), so each word costs two multiplies, not three
    # (1.32x the per-word multiply of u on 2 threads of a Xeon with AMX, 1.11x with the
    # vectors limited to AVX2: 28 tensors of 0.25-8 MB, 15 interleaved rounds)
    q = np.uint32(np.uint32(lo) + np.uint32(lo) + np.uint32(1))
    mu = np.uint32(np.uint32(lo) * np.uint32(0x9E3779B9))
    for k in range(hi - lo):
        x = part[k]
        h1 = np.uint32(h1 + np.uint32(x * q))
        m2 = np.uint32(mu | np.uint32(1))
        h2 = np.uint32(h2 + np.uint32(np.uint32(x ^ (x >> np.uint32(16))) * m2))
        q = np.uint32(q + np.uint32(2))
        mu = np.uint32(mu + np.uint32(0x9E3779B9))
    h1s[c] = h1
    h2s[c] = h2


def _build(numba):
    _numba.inline(_chunk_sums)
    return _numba.njit(_partials), _numba.njit(_serial, parallel=False)


_jit = _numba.once(globals(), _build)


def fingerprint_cpu(t: torch.Tensor) -> int:
    """``fxbackend.weights.fingerprint`` of a CPU tensor, in parallel on numba's threads."""
    if t.numel() == 0:
        return 0
    span = 1 + sum((s - 1) * st for s, st in zip(t.shape, t.stride()))
    arr = _flat(t, span).view(np.uint8)
    n4 = arr.shape[0] // 4 * 4
    parallel, serial = _jit()
    if n4:
        nchunks = -(-(n4 // 4) // CHUNK)
        h1s, h2s = np.empty(nchunks, np.uint64), np.empty(nchunks, np.uint64)
        if nchunks == 1:
            serial(arr[:n4].view(np.uint32), h1s, h2s)
        else:
            _set_threads()
            parallel(arr[:n4].view(np.uint32), CHUNK, h1s, h2s)
        # Python's sum of the few partial sums: numpy's reductions cost 1.9 us each
        h1 = sum(h1s.tolist()) & 0xFFFFFFFF
        h2 = sum(h2s.tolist()) & 0xFFFFFFFF
    else:
        h1 = h2 = 0
    h1, h2 = _weights._tail_mix(h1, h2, n4 // 4, arr[n4:].tobytes())
    return (h1 << 32) | h2


_weights.register_fingerprint("cpu", fingerprint_cpu)
