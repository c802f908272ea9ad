"""``fxbackend.weights.fingerprint``: the CPU kernel (``cpu_kernels/fingerprint.py``) equals the
torch reference on every dtype and layout, and sees the changes a derived value must follow."""
from __future__ import annotations

import pytest
import torch

from fxbackend import weights
from fxbackend.cpu_kernels.fingerprint import CHUNK, fingerprint_cpu

CASES = [  # (dtype, shape): odd byte counts leave 1-3 tail bytes; several parallel chunks
    (torch.float32, (1001,)), (torch.float32, (3, CHUNK + 5)), (torch.bfloat16, (7,)),
    (torch.bfloat16, (64, 33)), (torch.float16, (5, 3)), (torch.int8, (13,)),
    (torch.int8, (2, 2 * CHUNK + 3)), (torch.float64, (4, 4)), (torch.bool, (9,)),
    (torch.complex64, (3,)), (torch.float32, (0,)),
    # one chunk is hashed on the calling thread, more in parallel: both sides of the edge
    (torch.float32, (CHUNK,)), (torch.int8, (4 * CHUNK + 4,)), (torch.int8, (4 * CHUNK + 2,)),
]


def _tensor(dtype, shape, seed=0):
    g = torch.Generator().manual_seed(seed)
    if dtype == torch.bool:
        return torch.rand(shape, generator=g) > 0.5
    if not dtype.is_floating_point and not dtype.is_complex:
        return torch.randint(-100, 100, shape, generator=g, dtype=dtype)
    return torch.randn(shape, generator=g).to(dtype)


@pytest.mark.parametrize("dtype, shape", CASES)
def test_cpu_kernel_equals_the_torch_reference(dtype, shape):
    t = _tensor(dtype, shape)
    assert fingerprint_cpu(t) == weights.torch_fingerprint(t, chunk=1000)
    assert weights.fingerprint(t) == weights.torch_fingerprint(t)


def test_non_contiguous_tensors_hash_their_span():
    t = torch.randn(64, 33)[:, 1:30]
    assert fingerprint_cpu(t) == weights.torch_fingerprint(t)
    assert fingerprint_cpu(t.t()) == weights.torch_fingerprint(t.t())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.int8])
def test_changes_are_seen(dtype):
    t = _tensor(dtype, (257, 31), seed=1)
    base = weights.fingerprint(t)
    flat = t.view(-1)
    for i in (0, 1, flat.numel() // 2, flat.numel() - 1):  # any one element
        u = t.clone()
        u.view(-1)[i] = (flat[i] + 1).to(dtype) if dtype == torch.int8 else flat[i] * 2 + 1
        assert weights.fingerprint(u) != base
    swapped = t.clone()  # two elements swapped (a plain sum would not see it)
    v = swapped.view(-1)
    v[3], v[100] = flat[100].clone(), flat[3].clone()
    assert not torch.equal(swapped, t) and weights.fingerprint(swapped) != base
    assert weights.fingerprint(-t) != base  # every sign flipped (an xor would not see it)
    assert weights.fingerprint(t.clone()) == base  # the bytes, not the object


@pytest.mark.parametrize("scale", [-1.0, -0.5, 2.0, 0.5])
def test_a_uniform_scaling_of_a_power_of_two_sized_weight_is_seen(scale):
    """Scaling a float32 tensor by a power of two moves every word by the same amount mod
    2**32 (sign bit, exponent); over 2**k words a purely additive sum of the words can cancel
    that exactly (a 128 x 64 Linear weight multiplied by -0.5 through ``.data``)."""
    w = torch.nn.Linear(64, 128).weight.detach().clone()
    assert weights.fingerprint(w * scale) != weights.fingerprint(w)
    assert weights.torch_fingerprint(w * scale) != weights.torch_fingerprint(w)

def test_weight_key_sees_data_writes():
    p = torch.nn.Parameter(torch.randn(8, 8))
    k = weights.weight_key(p)
    version = p._version
    p.data.mul_(0.5)
    assert p._version == version  # the version counter misses it
    assert weights.weight_key(p) != k
