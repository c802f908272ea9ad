"""Values derived from weights (a weight's channels-last copy, a cast, a quantized weight): held
once per model and never served stale.

Contract.
- A derived value is kept in a :class:`DerivedCell`, found by :func:`cell` from the weight
  tensor objects it is computed from and a hashable description of the computation (``what``).
  Every plan of every compiled graph that derives the same thing from the same weights gets the
  same cell: a model compiled at K resolutions holds one copy, not K.  A cell goes when one of
  its weights is garbage collected (a weakref callback), never before.
- Before a cell's value is used, the caller compares :func:`weight_key` of each weight with the
  keys the value was computed from (``cell.key``) and recomputes on a difference.  The key is
  the weight's address, dtype, shape, strides and a **fingerprint of its bytes**
  (:func:`fingerprint`), computed on every call.  So every way of changing a weight is seen:
  in-place updates with or without the version counter (``p.data.mul_(..)``, an EMA update,
  peft's merge of a LoRA into ``base_layer.weight.data``), new storage (``p.data = ..``,
  ``load_state_dict(assign=True)``), copies into it (``load_state_dict``), inference-mode
  tensors (which have no version counter).  The version counter alone misses ``.data`` writes.
- The fingerprint is a position-weighted sum of the tensor's 32-bit words
  (``h1 = sum w[i] * (2i + 1)``, ``h2 = sum (w[i] ^ w[i] >> 16) * (i * 0x9E3779B9 | 1)``, both
  mod 2**32): a change of any single word always changes ``h1`` (the multipliers are odd);
  two words swapped, or several changed, go unseen only if both sums happen to agree.  Its
  cost is one read of the weight per call (see docs/BENCHMARKS.md: "weight check");
  :func:`freeze_weights` lets a user who never writes a weight through an alias trade it for
  the version counter.  A device may register a faster implementation of the same function
  (:func:`register_fingerprint`; ``cpu_kernels/fingerprint.py`` registers a parallel numba
  one for the CPU); the torch one here serves every other device.

- A derived value that a second derivation reads as its weight (W8A8's quantized form of the
  concatenated Q, K and V weights) is keyed by a serial number given when it was made
  (:func:`mark_derived`, called by the plan's cached steps), not by a fingerprint: its own
  weights are already checked, and a new computation makes a new tensor.

Thread safety: cells are created under a lock; a cell's ``key``/``value`` pair is replaced
as one tuple (:meth:`DerivedCell.set`), so a reader never sees a value with another's key.
"""
from __future__ import annotations

import itertools
import threading
import weakref
from typing import Any, Callable, Hashable, Sequence

import torch

__all__ = ["fingerprint", "register_fingerprint", "weight_key", "freeze_weights", "DerivedCell",
           "mark_derived", "cell", "what_id", "live_cells", "held_bytes", "torch_fingerprint"]

_M1 = 0x9E3779B9
_MASK32 = 0xFFFFFFFF

#: device type -> fingerprint function (``tensor -> int``); the torch one serves the others
_FINGERPRINTS: dict[str, Callable[[torch.Tensor], int]] = {}


def register_fingerprint(device_type: str, fn: Callable[[torch.Tensor], int]) -> None:
    """Use ``fn(tensor) -> int`` as :func:`fingerprint` for tensors on ``device_type``.  ``fn``
    must return :func:`torch_fingerprint`'s value for every tensor (tests compare them)."""
    if not callable(fn):
        raise TypeError(f"register_fingerprint: fn must be callable, got {type(fn).__name__}")
    _FINGERPRINTS[str(device_type)] = fn


def _words_and_tail(t: torch.Tensor) -> tuple[torch.Tensor, bytes]:
    """The bytes ``t`` spans from its offset (its whole span, gaps included), as int32 words
    and the 0-3 bytes left over."""
    if t.is_contiguous():
        flat = t.reshape(-1)
    else:
        span = 1 + sum((s - 1) * st for s, st in zip(t.shape, t.stride()) if s > 0) \
            if t.numel() else 0
        flat = torch.as_strided(t, (span,), (1,))
    b = flat.view(torch.uint8)
    n4 = b.numel() // 4 * 4
    tail = bytes(b[n4:].cpu().tolist()) if n4 != b.numel() else b""
    return b[:n4].view(torch.int32), tail


def _tail_mix(h1: int, h2: int, n_words: int, tail: bytes) -> tuple[int, int]:
    """The 0-3 trailing bytes as one more word (little-endian, zero-padded) at position
    ``n_words``."""
    if tail:
        x = int.from_bytes(tail, "little")
        h1 = (h1 + x * (2 * n_words + 1)) & _MASK32
        h2 = (h2 + (x ^ (x >> 16)) * (((n_words * _M1) | 1) & _MASK32)) & _MASK32
    return h1, h2


def torch_fingerprint(t: torch.Tensor, chunk: int = 1 << 20) -> int:
    """:func:`fingerprint` with torch operations on ``t``'s device (in chunks of ``chunk``
    words, so the temporaries stay small).  ``(h1 << 32) | h2`` (module docstring)."""
    words, tail = _words_and_tail(t)
    n = words.numel()
    h1 = h2 = 0
    for lo in range(0, n, chunk):
        w = words[lo:lo + chunk].to(torch.int64) & _MASK32
        i = torch.arange(lo, lo + w.numel(), device=w.device, dtype=torch.int64)
        h1 += int(((w * (2 * i + 1)) & _MASK32).sum())
        h2 += int((((w ^ (w >> 16)) * (((i * _M1) | 1) & _MASK32)) & _MASK32).sum())
    h1, h2 = _tail_mix(h1 & _MASK32, h2 & _MASK32, n, tail)
    return (h1 << 32) | h2


def fingerprint(t: torch.Tensor) -> int:
    """A 64-bit fingerprint of the bytes of ``t`` (module docstring), by the function
    registered for its device or :func:`torch_fingerprint`."""
    return _FINGERPRINTS.get(t.device.type, torch_fingerprint)(t)


def _remember(store: dict, t: torch.Tensor, payload: Any) -> bool:
    """``store[id(t)] = (a weak reference to t, payload)``, dropped when ``t`` goes (a tensor's
    ``==`` is elementwise, so no WeakSet or WeakKeyDictionary); False when ``t`` cannot be
    weakly referenced."""
    key = id(t)
    try:
        ref = weakref.ref(t, lambda r, key=key: store.get(key, (None,))[0] is r and
                          store.pop(key, None))
    except TypeError:
        return False
    store[key] = (ref, payload)
    return True


def _recall(store: dict, t: torch.Tensor) -> tuple | None:
    """``t``'s entry in a :func:`_remember` store (not that of a dead tensor whose id ``t``
    took over), else None."""
    got = store.get(id(t))
    return got if got is not None and got[0]() is t else None


#: the tensors :func:`freeze_weights` marked (:func:`_remember`): their keys use the version
#: counter instead of a fingerprint
_frozen: dict[int, tuple] = {}


def _is_frozen(t: torch.Tensor) -> bool:
    return _recall(_frozen, t) is not None


#: derived values (:func:`mark_derived`; :func:`_remember`, with the serial number given when
#: the value was made): a value computed again is a new tensor with a new number
_derived: dict[int, tuple] = {}
_serials = itertools.count(1)


def mark_derived(value: Any, weights: Sequence[torch.Tensor] = ()) -> None:
    """Note that the tensors of ``value`` (a tensor, or a tuple or list of them) are a derived
    value just made from ``weights`` and held in a cell: nothing writes them but the code that
    made them, and a new computation makes new tensors.  :func:`weight_key` of such a tensor
    (a step that derives a second value from the first: W8A8's quantized weight of the
    concatenated Q, K and V weights) is then a serial number given here, not a fingerprint of
    its bytes: the weights it came from are checked by fingerprint already.  A tensor that
    shares storage with one of ``weights`` (an op that returned its input) is not marked."""
    if isinstance(value, (tuple, list)):
        for v in value:
            mark_derived(v, weights)
        return
    if not isinstance(value, torch.Tensor):
        return
    ptr = value.untyped_storage().data_ptr()
    if any(isinstance(w, torch.Tensor) and w.untyped_storage().data_ptr() == ptr
           for w in weights):
        return
    _remember(_derived, value, next(_serials))


def weight_key(t: torch.Tensor) -> tuple:
    """What a value derived from ``t`` was computed from: address, dtype, shape, strides and
    :func:`fingerprint`.  Equal keys mean equal bytes (up to the fingerprint's collisions).
    For a tensor :func:`freeze_weights` marked (not an inference tensor, which has no version
    counter), the version counter replaces the fingerprint: no read of its bytes; for a
    derived value (:func:`mark_derived`), its serial number and version counter."""
    if _derived:
        got = _recall(_derived, t)
        if got is not None:
            return t.data_ptr(), t.dtype, tuple(t.shape), t.stride(), \
                ("derived", got[1], None if t.is_inference() else t._version)
    if _frozen and _is_frozen(t) and not t.is_inference():
        return t.data_ptr(), t.dtype, tuple(t.shape), t.stride(), ("version", t._version)
    return t.data_ptr(), t.dtype, tuple(t.shape), t.stride(), fingerprint(t)


def freeze_weights(weights: Any, frozen: bool = True) -> int:
    """Promise that ``weights`` (an ``nn.Module``: its parameters and buffers; or a tensor or
    an iterable of tensors) are changed only through themselves, never through another tensor
    that shares their storage; ``frozen=False`` takes the promise back.  Returns the number of
    tensors given.

    A value derived from a marked weight (a channels-last or cast copy, W8A8's quantized
    weight) is then checked every call by the weight's address, layout and version counter
    instead of a fingerprint of its bytes, which reads the whole weight (about 6% of a call of
    the small bf16 UNet and the small W8A8 Flux on a 2-thread Xeon with AMX: 29 and 38 MB).
    Still seen: in-place ops on the weight itself (``p.mul_(..)``, ``p.copy_(..)``,
    ``load_state_dict``), new storage (``p.data = t``, ``load_state_dict(assign=True)``).
    **Not seen: writes through an alias**, such as ``p.data.mul_(..)``, ``p.data.copy_(..)``
    (peft's LoRA merge, some EMA code) or a view of the weight taken with ``.detach()``: those
    leave the derived values stale until the weight changes in a way that is seen.  Keep the
    default (no promise) where such writes may happen."""
    if isinstance(weights, torch.nn.Module):
        tensors = [*weights.parameters(), *weights.buffers()]
    elif isinstance(weights, torch.Tensor):
        tensors = [weights]
    else:
        try:
            tensors = list(weights)
        except TypeError:
            raise TypeError(f"freeze_weights: weights must be an nn.Module, a tensor or an "
                            f"iterable of tensors, got {type(weights).__name__}") from None
        bad = [type(t).__name__ for t in tensors if not isinstance(t, torch.Tensor)]
        if bad:
            raise TypeError(f"freeze_weights: weights must be tensors, got {bad[0]}")
    for t in tensors:
        if not frozen:
            if _is_frozen(t):
                del _frozen[id(t)]
            continue
        _remember(_frozen, t, None)
    return len(tensors)


class DerivedCell:
    """One derived value and the weight keys it was computed from (``None`` before the
    first computation).  ``get(keys, compute)`` returns the value, calling ``compute()`` when
    ``keys`` differ from those of the value held; ``computed`` counts the computations."""

    __slots__ = ("_pair", "computed", "__weakref__")

    def __init__(self) -> None:
        self._pair: tuple = (None, None)
        self.computed = 0

    @property
    def key(self) -> Any:
        return self._pair[0]

    @property
    def value(self) -> Any:
        return self._pair[1]

    def set(self, key: Any, value: Any) -> None:
        self._pair = (key, value)
        self.computed += 1

    def clear(self) -> None:
        """Drop the value held (its weight went, or a test wants it made again): the next
        ``get`` computes it."""
        self._pair = (None, None)

    def get(self, key: Any, compute: Callable[[], Any]) -> Any:
        k, v = self._pair
        if k != key or k is None:
            v = compute()
            self.set(key, v)
        return v


# (ids of the weight objects, what) -> weakref to the cell: the plans using a cell hold it
# (``holder``), so a cell no plan uses goes; a weight's weakref callback drops its cells
_cells: dict[tuple, weakref.ref] = {}
# id(weight) -> (weakref, set of _cells keys naming it)
_by_weight: dict[int, tuple[weakref.ref, set]] = {}
_lock = threading.RLock()  # re-entrant: a cell dropped under it calls _drop


def _forget(wid: int, ref: weakref.ref) -> None:
    with _lock:
        got = _by_weight.get(wid)
        if got is not None and got[0] is ref:  # not a newer object's entry under that id
            del _by_weight[wid]
            for k in got[1]:
                c = _cells.pop(k, None)
                c = c() if c is not None else None
                if c is not None:  # a plan may still hold it: free the value now
                    c.clear()


def _lookup(key: tuple) -> DerivedCell | None:
    r = _cells.get(key)
    return r() if r is not None else None


def cell(weights: tuple, what: Hashable, holder: dict | None = None) -> DerivedCell:
    """The shared cell of the value ``what`` derived from the tensor objects ``weights`` (in
    order).  ``what`` must describe the whole computation from those tensors (op, arguments,
    result layout): two different computations with the same ``what`` would share a value.
    The cell lives while some ``holder`` (a dict the caller keeps, e.g. a plan's) holds it and
    none of its weights has gone; it is put in ``holder`` under the same key.  A tensor that
    cannot be weakly referenced gets a cell of its own (not shared)."""
    key = (tuple(id(w) for w in weights), what)
    got = _lookup(key)
    if got is None:
        with _lock:
            got = _lookup(key)
            if got is None:
                got = _new_cell(key, weights)
    if holder is not None:
        holder[key] = got
    return got


def _new_cell(key: tuple, weights: tuple) -> DerivedCell:
    entries = []
    for w in weights:
        entry = _by_weight.get(id(w))
        if entry is None or entry[0]() is not w:
            try:
                ref = weakref.ref(w, lambda r, wid=id(w): _forget(wid, r))
            except TypeError:
                return DerivedCell()
            entry = (ref, set())
            _by_weight[id(w)] = entry
        entries.append(entry)
    c = DerivedCell()
    _cells[key] = weakref.ref(c, lambda _, key=key: _drop(key))
    for entry in entries:
        entry[1].add(key)
    return c


def _drop(key: tuple) -> None:
    with _lock:
        r = _cells.get(key)
        if r is not None and r() is None:
            del _cells[key]
            for wid in key[0]:
                entry = _by_weight.get(wid)
                if entry is not None:
                    entry[1].discard(key)


_whats: dict[Hashable, int] = {}


def what_id(what: Hashable) -> int:
    """A small int standing for the description ``what`` (equal descriptions, equal ints), so
    that the per-call lookup hashes an int, not a nested tuple."""
    got = _whats.get(what)
    if got is None:
        with _lock:
            got = _whats.setdefault(what, len(_whats))
    return got


def live_cells() -> list[DerivedCell]:
    """Every cell alive now (for tests and the memory report)."""
    with _lock:
        return [c for c in (r() for r in _cells.values()) if c is not None]


def held_bytes() -> int:
    """Bytes of the tensors the live cells hold (each storage counted once)."""
    seen: dict[int, int] = {}

    def add(v: Any) -> None:
        if isinstance(v, torch.Tensor):
            s = v.untyped_storage()
            seen[s.data_ptr()] = s.nbytes()
        elif isinstance(v, (tuple, list)):
            for x in v:
                add(x)
    for c in live_cells():
        add(c.value)
    return sum(seen.values())
