"""INT8 W8A8 with ConvRot (patterns/int8.py, cpu_kernels/int8.py, cuda_kernels/int8.py).

- the references: the Hadamard matrices (orthogonal, regular, the documented order-4 matrix),
  the rotation against the matrix product, the row quantization's rounding and zero rows, the
  packed layout (offsets, padding, views), graph-build errors, serialize/deserialize;
- the numba kernels, parametrised against the references and bit-exact: odd row counts
  (1, 3, 5, 17: padding rows), K in (4, 12, 256, 768), every group dividing K, every x_kind x
  w_kind, with and without a bias, 16-bit inputs; the float weight quantized once and again
  after an in-place change; declining (K or N % 4, malformed scales, strided operands: the
  reference runs natively, same result); cancellation between the phases;
- the torch.library ops eagerly and through ``torch.compile(backend="fxbackend")``;
- the Triton kernels in the interpreter (tests/_int8_interp_check.py, a subprocess) at small
  sizes, their ``supports`` on CUDA metadata, compilation to sm_90 without a GPU, and
  ``cuda``-marked checks at real sizes (skipped without a GPU).

numba compiles the kernels once per dtype (cached on disk): a first run pays a few seconds.
"""
from __future__ import annotations

import os

import pytest
import torch

import fxbackend
from fxbackend import Graph, TensorMeta, services
from fxbackend.cpu_kernels import int8 as cpu_int8
from fxbackend.cuda_kernels import int8 as cuda_int8
from fxbackend.patterns import int8 as I
from fxbackend.patterns.int8 import (REGULAR_HADAMARD_GROUPS, hadamard, linear_i8_reference,
                                     packed_nbytes, quantize_i8_convrot_reference,
                                     quantize_weight_i8_reference, rotate_reference, unpack)

from _rope_interp_check import check_result, run_checker
from ext_util import compiled, set_outputs

QUANT, LINEAR = "sd.quantize_i8_convrot.v1", "sd.linear_i8.v1"
F32, BF16, F16 = torch.float32, torch.bfloat16, torch.float16
#: (M rows, K, N): odd row counts (padding rows in the packed layout) and K of every group
SHAPES = [(1, 4, 4), (3, 12, 8), (5, 256, 12), (17, 768, 20)]


def _groups(k: int) -> list:
    return [g for g in REGULAR_HADAMARD_GROUPS if k % g == 0]


def _input(g, t: torch.Tensor):
    return g.append(g.new_node("input", meta=TensorMeta.of(t), is_input=True))


def _graph(op: str, ts: list, attrs: dict):
    g = Graph()
    node = fxbackend.op_create(g, op, [_input(g, t) for t in ts], attrs)
    set_outputs(g, node)
    return g, node


def _run(op: str, ts: list, attrs: dict):
    """One node on these inputs through a CompiledGraph: (result, steps by kernel)."""
    g, _ = _graph(op, ts, attrs)
    fxbackend.reset_stats()
    (out,) = compiled(g)(*ts)
    return out, dict(fxbackend.stats()["steps_by_kernel"])


def _acts(shape, gen, dtype=F32) -> torch.Tensor:
    """Activations with an outlier channel (what ConvRot is for)."""
    x = torch.randn(*shape, generator=gen) * 2
    if shape[-1] > 4:
        x[..., 3] *= 50
    return x.to(dtype)


def _linear_case(x_kind, w_kind, bias, M, K, N, group, gen, dtype=F32, lead=None):
    """``(sources, attrs)`` of one sd.linear_i8.v1 node."""
    lead = (M,) if lead is None else lead
    x = _acts(lead + (K,), gen, dtype)
    w = (torch.randn(N, K, generator=gen) * 0.05).to(dtype)
    attrs = {"x_kind": x_kind, "w_kind": w_kind, "group": group, "has_bias": bias}
    if x_kind == "packed":
        srcs = [quantize_i8_convrot_reference(x, group)]
        attrs.update(m=M, lead=lead)
    elif x_kind == "int8":
        srcs = [torch.randint(-127, 128, lead + (K,), dtype=torch.int8, generator=gen)]
    else:
        srcs = [x]
    srcs += list(quantize_weight_i8_reference(w, group)) if w_kind == "int8" else [w]
    if x_kind == "int8":
        srcs.append(torch.rand(M, generator=gen) * 0.05 + 1e-3)
    if bias:
        srcs.append(torch.randn(N, generator=gen).to(dtype))
    return srcs, attrs


def _reference(srcs, attrs):
    """linear_i8's meaning for the kernel of the operands' device: on the CPU a float weight is
    quantized with the codes the profile's int8 GEMM takes (7 bits on a prepacked engine)."""
    s = I.linear_srcs(srcs, attrs)
    on_cpu = attrs["w_kind"] == "float" and srcs[0].device.type == "cpu"
    qmax = fxbackend.cpu.int8_weight_max() if on_cpu else I.QMAX
    return linear_i8_reference(**s, x_kind=attrs["x_kind"], w_kind=attrs["w_kind"],
                               group=attrs["group"], m=attrs.get("m", -1),
                               lead=attrs.get("lead", ()), w_qmax=qmax)


# -- the references --------------------------------------------------------------------------------

@pytest.mark.parametrize("group", REGULAR_HADAMARD_GROUPS)
def test_hadamard_is_orthogonal_regular_and_symmetric(group):
    h = hadamard(group)
    assert h.shape == (group, group) and h.dtype == F32
    # entries +-2^-k: every product and partial sum below is exact in float32
    assert torch.equal(h.abs(), torch.full_like(h, group ** -0.5))
    assert torch.equal(h @ h.T, torch.eye(group))
    assert torch.equal(h, h.T)
    assert torch.equal(h.sum(0), torch.ones(group)) and torch.equal(h.sum(1), torch.ones(group))


def test_hadamard_order_4_is_the_documented_matrix_and_higher_orders_its_kronecker_powers():
    a = torch.tensor([[1, 1, 1, -1], [1, 1, -1, 1], [1, -1, 1, 1], [-1, 1, 1, 1]], dtype=F32)
    assert torch.equal(hadamard(4), a / 2)
    assert torch.equal(hadamard(16), torch.kron(a, a) / 4)
    assert torch.equal(hadamard(1), torch.ones(1, 1))


@pytest.mark.parametrize("group", [0, 2, 8, 32, 512, True, 4.0])
def test_hadamard_rejects_other_orders(group):
    with pytest.raises(ValueError, match=r"group must be one of \(1, 4, 16, 64, 256\)"):
        hadamard(group)


@pytest.mark.parametrize("group", REGULAR_HADAMARD_GROUPS)
def test_rotation_is_the_group_wise_matrix_product(group):
    gen = torch.Generator().manual_seed(group)
    x = _acts((3, 2, 2 * max(group, 4)), gen)
    r = rotate_reference(x, group)
    want = (x.double().reshape(3, 2, -1, group) @ hadamard(group).double()).reshape(x.shape)
    # float32 butterfly vs the float64 product: a few ulps of the row's magnitude
    torch.testing.assert_close(r.double(), want, atol=1e-4 * x.abs().max().item(), rtol=1e-5)
    back = rotate_reference(r, group)  # H is symmetric and orthogonal: its own inverse
    torch.testing.assert_close(back, x, atol=1e-4 * x.abs().max().item(), rtol=1e-5)


def test_row_quantization_rounds_half_to_even_and_maps_zero_rows_to_scale_one():
    # a row with amax 127 has scale 1.0, so the codes are the rounded values themselves
    r = torch.tensor([[0.5, 1.5, 2.5, -0.5, -2.5, 126.5, -127.0, 3.49],
                      [0.0] * 8, [1e-44] * 8], dtype=F32)
    q, s = I.quantize_rows_reference(r)
    assert s.tolist() == [1.0, 1.0, 1.0]  # the last row's amax / 127 underflows to 0
    assert q[0].tolist() == [0, 2, 2, 0, -2, 126, -127, 3]
    assert q[1:].eq(0).all()
    gen = torch.Generator().manual_seed(3)
    x = _acts((6, 64), gen)
    q, s = I.quantize_rows_reference(x)
    assert torch.equal(s, x.abs().amax(1) / 127)
    assert q.abs().amax(1).eq(127).all()  # each row's largest entry takes the full range
    # dequantized within half a step of each value
    assert ((q.float() * s[:, None] - x).abs() <= s[:, None] * 0.5 * (1 + 1e-6)).all()


@pytest.mark.parametrize("m", [0, 1, 3, 4, 5, 17])
def test_packed_layout_offsets_padding_and_views(m):
    k = 12
    gen = torch.Generator().manual_seed(m)
    x = _acts((m, k), gen)
    mp = (m + 3) // 4 * 4
    assert packed_nbytes(m, k) == mp * k + 4 * mp
    p = quantize_i8_convrot_reference(x, 4)
    assert p.dtype == torch.int8 and p.shape == (packed_nbytes(m, k),)
    q, s = unpack(p, m, k)
    want_q, want_s = I.quantize_rows_reference(rotate_reference(x, 4))
    assert torch.equal(q, want_q) and torch.equal(s, want_s)
    # the layout itself: rows, zero padding rows, float32 scales, zero padding scales
    assert torch.equal(p[:m * k].view(m, k), want_q)
    assert p[m * k: mp * k].eq(0).all()
    assert torch.equal(p[mp * k: mp * k + 4 * m].view(F32), want_s)
    assert p[mp * k + 4 * m:].eq(0).all()
    if m:  # views into p, no copies
        assert q.data_ptr() == p.data_ptr()
        assert s.data_ptr() == p.data_ptr() + mp * k
    assert torch.equal(I.pack(q, s), p)


def test_unpack_copies_scales_of_a_misaligned_tensor_and_checks_the_size():
    p = quantize_i8_convrot_reference(torch.randn(3, 8), 4)
    shifted = torch.cat([torch.zeros(1, dtype=torch.int8), p])[1:]  # storage offset 1
    q, s = unpack(shifted, 3, 8)
    q0, s0 = unpack(p, 3, 8)
    assert torch.equal(q, q0) and torch.equal(s, s0)
    with pytest.raises(ValueError, match="3 rows of 9 features take 52 bytes packed, got a "
                                         "tensor of 48"):
        unpack(p, 3, 9)


def test_int_mm_is_exact_here_at_the_extremes():
    """The CPU integer GEMM must not saturate (some int8 paths accumulate pairs in int16)."""
    a = torch.full((8, 4096), -128, dtype=torch.int8)
    a[:, 1::2] = 127
    b = torch.full((16, 4096), -128, dtype=torch.int8)
    b[::2] = 127
    assert torch.equal(I.int_dot(a, b), (a.double() @ b.double().T).to(torch.int32))


# -- graph-build errors ----------------------------------------------------------------------------

def _meta_graph(*metas):
    g = Graph()
    return g, [g.append(g.new_node("input", meta=TensorMeta.contiguous(s, dt, torch.device("cpu")),
                                   is_input=True)) for s, dt in metas]


@pytest.mark.parametrize("metas, attrs, match", [
    ([((4, 12), F32)], {"group": 8}, r"group must be one of \(1, 4, 16, 64, 256\).*got 8"),
    ([((4, 12), F32)], {"group": 16}, r"x's last dim K=12 must be a multiple of group=16"),
    ([((4, 12), torch.int8)], {"group": 4}, r"x must be float32, bfloat16 or float16 .*int8"),
    ([((4, 12), torch.float64)], {}, r"x must be float32, bfloat16 or float16"),
    ([((4, 0), F32)], {}, r"non-empty feature"),
], ids=["group", "k_group", "int8_x", "f64_x", "empty_k"])
def test_quantize_graph_build_errors(metas, attrs, match):
    g, srcs = _meta_graph(*metas)
    with pytest.raises(ValueError, match=match):
        fxbackend.op_create(g, QUANT, srcs, attrs)


@pytest.mark.parametrize("metas, attrs, match", [
    ([((4, 12), F32), ((8, 12), F32)], {"x_kind": "float", "w_kind": "float", "group": 8},
     r"group must be one of"),
    ([((4, 12), F32), ((8, 12), F32)], {"x_kind": "float", "w_kind": "float", "group": 16},
     r"K=12 .* must be a positive multiple of group=16"),
    ([((4, 12), torch.int32), ((8, 12), F32)], {"x_kind": "float", "w_kind": "float"},
     r"x_kind='float' needs a float32, bfloat16 or float16 x, got torch.int32"),
    ([((4, 12), F32), ((8, 12), F32), ((8,), F32)], {"x_kind": "float", "w_kind": "int8"},
     r"w_kind='int8' needs an int8 w, got torch.float32"),
    ([((4, 12), F32), ((8, 12), torch.int8)], {"x_kind": "float", "w_kind": "int8"},
     r"sources are \(x, w, w_scale\), got 2 sources"),
    ([((4, 12), F32), ((8, 12), torch.int8), ((7,), F32)], {"x_kind": "float", "w_kind": "int8"},
     r"w_scale must have 8 elements \(one per output channel\), got shape \(7,\)"),
    ([((4, 10), F32), ((8, 12), F32)], {"x_kind": "float", "w_kind": "float"},
     r"x must be \[..., K\] with K=12"),
    ([((100,), torch.int8), ((8, 12), F32)], {"x_kind": "packed", "w_kind": "float"},
     r"x_kind='packed' needs the attribute m"),
    ([((100,), torch.int8), ((8, 12), F32)], {"x_kind": "packed", "w_kind": "float", "m": 5,
                                              "lead": (5,)},
     r"packed x of m=5 rows of K=12 features has 128 bytes, got 100"),
    ([((128,), torch.int8), ((8, 12), F32)], {"x_kind": "packed", "w_kind": "float", "m": 5,
                                              "lead": (2, 2)},
     r"lead \(2, 2\) must multiply to m=5"),
    ([((4, 12), torch.int8), ((8, 12), F32), ((3,), F32)], {"x_kind": "int8", "w_kind": "float"},
     r"x_scale must have 4 elements \(one per row of x\)"),
    ([((4, 12), F32), ((8, 12), F32), ((8,), torch.int32)],
     {"x_kind": "float", "w_kind": "float", "has_bias": True}, r"bias must be float32"),
    ([((4, 12), F32), ((8, 12), F32)], {"x_kind": "fp8", "w_kind": "float"},
     r"x_kind must be one of \('float', 'packed', 'int8'\), got 'fp8'"),
], ids=["group", "k_group", "x_dtype", "w_dtype", "missing_w_scale", "w_scale_size", "k_mismatch",
        "packed_no_m", "packed_size", "lead", "x_scale_size", "bias_dtype", "x_kind"])
def test_linear_graph_build_errors(metas, attrs, match):
    g, srcs = _meta_graph(*metas)
    with pytest.raises(ValueError, match=match):
        fxbackend.op_create(g, LINEAR, srcs, attrs)


def test_serialize_round_trips_the_attributes():
    g, (x, w, b) = _meta_graph(((2, 3, 16), F32), ((8, 16), F32), ((8,), F32))
    lin = fxbackend.op_create(g, LINEAR, [x, w, b], {"x_kind": "float", "w_kind": "float",
                                                      "group": 16, "has_bias": True})
    q = fxbackend.op_create(g, QUANT, [x], {"group": 4})
    p = fxbackend.op_create(g, LINEAR, [q, w], {"x_kind": "packed", "w_kind": "float",
                                                "group": 4, "m": 6, "lead": (2, 3)})
    for node in (lin, q, p):
        op = fxbackend.get_op(node.op)
        data = fxbackend.ops.serialize_attrs(op, node)
        assert all(not isinstance(v, tuple) for v in data.values())  # plain JSON
        assert fxbackend.ops.deserialize_attrs(op, data) == node.params
    assert fxbackend.ops.serialize_attrs(fxbackend.get_op(LINEAR), p)["lead"] == [2, 3]


# -- the numba kernels -----------------------------------------------------------------------------

QUANT_CASES = [(m, k, g) for m, k, _ in SHAPES for g in _groups(k)]


@pytest.mark.parametrize("m, k, group", QUANT_CASES,
                         ids=[f"{m}x{k}-g{g}" for m, k, g in QUANT_CASES])
def test_cpu_quantize_is_bit_exact(m, k, group):
    gen = torch.Generator().manual_seed(m * 1000 + k + group)
    x = _acts((m, k), gen)
    out, steps = _run(QUANT, [x], {"group": group})
    assert steps == {"quantize_i8_convrot_cpu": 1}
    assert torch.equal(out, quantize_i8_convrot_reference(x, group))


@pytest.mark.parametrize("group", [1, 16])
def test_cpu_quantize_special_rows(group):
    """Zero rows (scale 1.0), rows whose amax / 127 underflows, subnormal and huge values, a
    negative maximum, exact ties of the rounding: bit-equal to the reference."""
    gen = torch.Generator().manual_seed(group)
    x = torch.randn(8, 32, generator=gen)
    x[0] = 0.0
    x[1] = -0.0
    x[2] = torch.full((32,), 1e-44) * torch.sign(torch.randn(32, generator=gen))
    x[3] *= 1e-39  # subnormals
    x[4] *= 1e30
    x[5, 7] = -500.0  # the largest magnitude is negative
    x[6] = torch.arange(32) - 15.5  # amax 16.5 (group 1): many values land on .5 ties
    x[7] = torch.arange(32) * 4.0 - 127.0  # group 1: scale exactly 1.0, every code a tie-free int
    out, steps = _run(QUANT, [x], {"group": group})
    assert steps == {"quantize_i8_convrot_cpu": 1}
    assert torch.equal(out, quantize_i8_convrot_reference(x, group))
    _, s = unpack(out, 8, 32)
    assert s[0] == 1.0 and s[1] == 1.0 and s[2] == 1.0


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("dtype", [F32, BF16, F16], ids=["f32", "bf16", "f16"])
@pytest.mark.parametrize("group", REGULAR_HADAMARD_GROUPS)
def test_cpu_quantize_kernel_paths_every_group(group, dtype, threads):
    """The kernel's code paths: no rotation (group 1, codes straight from x), stage 0, the
    stride-4 stage, the vector stages of stride >= 16; an odd number of groups a row; several
    parallel tasks of whole rows, the last one short, and padding rows; special rows."""
    k = 3 * max(group, 16)
    m = 301  # 2 threads: tasks of 64 rows (rows_per_task), 304 packed rows (3 padding)
    gen = torch.Generator().manual_seed(group)
    x = torch.randn(m, k, generator=gen) * torch.logspace(-2, 2, k)
    x[0] = 0.0
    x[1, 5] = -1e4  # the largest magnitude is negative
    x[2] *= 1e-39  # subnormals
    x[3] = torch.arange(k) - k / 2 + 0.5  # many .5 ties for group 1
    x = x.to(dtype)
    old = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        out = cpu_int8.quantize_i8_convrot_cpu(x, group)
    finally:
        torch.set_num_threads(old)
    assert torch.equal(out, quantize_i8_convrot_reference(x, group))
    q, s = unpack(out, m, k)
    assert s[0] == 1.0 and not q[0].any()


def test_rows_per_task_balances_and_bounds_the_tasks():
    assert cpu_int8.rows_per_task(1024, 3072, 2) == 128  # 4 tasks a thread
    assert cpu_int8.rows_per_task(1024, 256, 2) == 128
    assert cpu_int8.rows_per_task(100, 256, 2) == 64  # at least 16384 elements a task
    assert cpu_int8.rows_per_task(3, 256, 2) == 3
    assert cpu_int8.rows_per_task(0, 256, 2) == 1


@pytest.mark.parametrize("dtype", [BF16, F16])
def test_cpu_quantize_16_bit_inputs(dtype):
    gen = torch.Generator().manual_seed(11)
    x = _acts((2, 3, 256), gen, dtype)
    out, steps = _run(QUANT, [x], {"group": 64})
    assert steps == {"quantize_i8_convrot_cpu": 1}
    assert torch.equal(out, quantize_i8_convrot_reference(x, 64))


@pytest.mark.parametrize("bias", [False, True], ids=["nobias", "bias"])
@pytest.mark.parametrize("w_kind", ["int8", "float"])
@pytest.mark.parametrize("x_kind", ["float", "packed", "int8"])
@pytest.mark.parametrize("M, K, N", SHAPES, ids=[f"{m}x{k}x{n}" for m, k, n in SHAPES])
def test_cpu_linear_is_bit_exact(M, K, N, x_kind, w_kind, bias):
    for group in _groups(K):
        gen = torch.Generator().manual_seed(M * 7919 + K * 31 + N + group)
        srcs, attrs = _linear_case(x_kind, w_kind, bias, M, K, N, group, gen)
        out, steps = _run(LINEAR, srcs, attrs)
        assert steps == {"linear_i8_cpu": 1}, (group, steps)
        want = _reference(srcs, attrs)
        assert out.shape == want.shape == (M, N) and out.dtype == F32
        assert torch.equal(out, want), (group, (out - want).abs().max().item())


@pytest.mark.parametrize("dtype", [BF16, F16])
def test_cpu_linear_16_bit_activations_weights_and_bias(dtype):
    gen = torch.Generator().manual_seed(21)
    srcs, attrs = _linear_case("float", "float", True, 6, 64, 8, 16, gen, dtype, lead=(2, 3))
    out, steps = _run(LINEAR, srcs, attrs)
    assert steps == {"linear_i8_cpu": 1}
    assert out.shape == (2, 3, 8) and torch.equal(out, _reference(srcs, attrs))


def test_w8a8_output_is_close_to_the_float_linear():
    """Not bit-level: the point of the op (with an outlier channel, ConvRot helps)."""
    gen = torch.Generator().manual_seed(5)
    x = _acts((64, 256), gen)
    w = torch.randn(32, 256, generator=gen) * 0.05
    exact = x @ w.T

    def cos(group):
        out = linear_i8_reference(x, w, x_kind="float", w_kind="float", group=group)
        return torch.nn.functional.cosine_similarity(out.flatten(), exact.flatten(), 0).item()

    assert cos(1) > 0.97 and cos(256) > 0.995 and cos(256) > cos(1)


class _CountQuantizations:
    def __init__(self, monkeypatch):
        self.calls = 0
        real = cpu_int8.DEVICE.quantize_weight

        def counting(*args):
            self.calls += 1
            real(*args)
        monkeypatch.setattr(cpu_int8.DEVICE, "quantize_weight", counting)


def test_float_weight_is_quantized_once_and_again_after_an_in_place_change(monkeypatch):
    count = _CountQuantizations(monkeypatch)
    gen = torch.Generator().manual_seed(8)
    srcs, attrs = _linear_case("float", "float", True, 5, 64, 8, 16, gen)
    g, _ = _graph(LINEAR, srcs, attrs)
    cg = compiled(g)
    for _ in range(3):
        (out,) = cg.run(srcs)
        assert torch.equal(out, _reference(srcs, attrs))
    assert count.calls == 1, "an unchanged weight is quantized once per plan"
    w = srcs[1]
    with torch.no_grad():
        w.copy_(torch.randn(w.shape, generator=gen) * 0.05)  # a LoRA fuse: same tensor, new data
    (out,) = cg.run(srcs)
    assert count.calls == 2
    assert torch.equal(out, _reference(srcs, attrs))
    w2 = w.clone()  # another tensor (address) with the same values: quantized again, same result
    (out2,) = cg.run([srcs[0], w2, srcs[2]])
    assert count.calls == 3 and torch.equal(out2, out)
    cg.run([srcs[0], w2, srcs[2]])
    assert count.calls == 3


def test_inference_tensor_weights_are_quantized_once_and_again_when_changed(monkeypatch):
    """An inference-mode weight has no version counter; the fingerprint of its bytes
    (``fxbackend.weights``) still tells an unchanged weight from a changed one."""
    count = _CountQuantizations(monkeypatch)
    gen = torch.Generator().manual_seed(9)
    srcs, attrs = _linear_case("float", "float", False, 3, 16, 4, 4, gen)
    with torch.inference_mode():
        w = srcs[1].clone()
    g, _ = _graph(LINEAR, [srcs[0], w], attrs)
    cg = compiled(g)
    for _ in range(2):
        (out,) = cg.run([srcs[0], w])
    assert count.calls == 1
    assert torch.equal(out, _reference([srcs[0], w], attrs))
    with torch.inference_mode():
        w.mul_(-0.5)
    (out,) = cg.run([srcs[0], w])
    assert count.calls == 2
    assert torch.equal(out, _reference([srcs[0], w], attrs))


def _declined(srcs, attrs, reason):
    g, node = _graph(LINEAR, srcs, attrs)
    assert cpu_int8.linear_kernel.why_not(node) is not None
    assert reason in cpu_int8.linear_kernel.why_not(node)
    fxbackend.reset_stats()
    (out,) = compiled(g)(*srcs)
    assert dict(fxbackend.stats()["steps_by_kernel"]) == {"native": 1}
    assert torch.equal(out, _reference(srcs, attrs))


@pytest.mark.parametrize("K, N", [(6, 8), (8, 6)], ids=["k6", "n6"])
def test_cpu_linear_declines_k_or_n_not_divisible_by_4(K, N):
    gen = torch.Generator().manual_seed(K * N)
    srcs, attrs = _linear_case("float", "int8", True, 5, K, N, 1, gen)
    _declined(srcs, attrs, f"K={K} and N={N} must be multiples of 4")


@pytest.mark.parametrize("case", ["w_scale_2d", "x_scale_bf16", "x_scale_strided",
                                  "bias_2d", "x_transposed"])
def test_cpu_linear_declines_malformed_scales_and_layouts(case):
    gen = torch.Generator().manual_seed(4)
    x_kind = "int8" if case.startswith("x_scale") else "float"
    srcs, attrs = _linear_case(x_kind, "int8", case == "bias_2d", 8, 16, 8, 4, gen)
    if case == "w_scale_2d":
        srcs[2], reason = srcs[2].reshape(8, 1), "w_scale must be float32 [8] contiguous"
    elif case == "x_scale_bf16":
        srcs[3], reason = srcs[3].to(BF16), "x_scale must be float32 [8] contiguous"
    elif case == "x_scale_strided":
        srcs[3], reason = torch.rand(16, generator=gen)[::2], "x_scale must be float32"
    elif case == "bias_2d":
        srcs[3], reason = srcs[3].reshape(1, 8), "bias must be [8] contiguous"
    else:
        srcs[0], reason = srcs[0].T.contiguous().T, "x and w must be contiguous"
    _declined(srcs, attrs, reason)


def test_supports_never_raises():
    k = cpu_int8.linear_kernel
    gen = torch.Generator().manual_seed(1)
    srcs, attrs = _linear_case("float", "int8", False, 4, 8, 4, 4, gen)
    _, node = _graph(LINEAR, srcs, attrs)
    assert k.supports(node)
    saved = dict(node.params)
    for broken in ({}, {**saved, "x_kind": None}, {**saved, "group": 3}, {**saved, "lead": 5}):
        node.params = broken
        assert k.supports(node) is False
    node.params = saved
    for srcs_ in ([], node.srcs[:1], [object(), object(), object()]):
        node.srcs = srcs_
        assert k.supports(node) is False
        assert cpu_int8.quantize_kernel.supports(node) is False


def test_strides_other_than_planned_are_read_correctly():
    """Behind Dynamo's guards ``run`` does not validate strides: a transposed x at run time is
    made contiguous by the kernel rather than misread."""
    gen = torch.Generator().manual_seed(12)
    srcs, attrs = _linear_case("float", "int8", True, 8, 16, 8, 4, gen)
    g, _ = _graph(LINEAR, srcs, attrs)
    cg = compiled(g)
    strided = [srcs[0].T.contiguous().T] + srcs[1:]
    (out,) = cg.run(strided)
    assert torch.equal(out, _reference(srcs, attrs))


def test_cancelling_between_quantize_and_gemm(monkeypatch):
    gen = torch.Generator().manual_seed(13)
    srcs, attrs = _linear_case("float", "int8", False, 8, 16, 8, 4, gen)
    g, _ = _graph(LINEAR, srcs, attrs)
    cg = compiled(g)
    plan = cg.plan_for(srcs)
    real_quantize, gemms = cpu_int8.DEVICE.quantize_rows, []

    def quantize_then_cancel(*args):
        real_quantize(*args)
        plan.cancel()  # as another thread would, while the step quantizes
    monkeypatch.setattr(cpu_int8.DEVICE, "quantize_rows", quantize_then_cancel)
    real_gemm = cpu_int8.DEVICE.gemm  # whichever int8 GEMM this CPU's profile runs
    monkeypatch.setattr(cpu_int8.DEVICE, "gemm", lambda *a: gemms.append(1) or real_gemm(*a))
    with pytest.raises(services.Cancelled, match="cancelled"):
        cg(*srcs)
    assert gemms == [], "the GEMM must not start after a cancellation"
    monkeypatch.setattr(cpu_int8.DEVICE, "quantize_rows", real_quantize)
    (out,) = cg(*srcs)  # a cancellation ends that call only
    assert gemms == [1] and torch.equal(out, _reference(srcs, attrs))


def test_launchers_direct_calls_and_errors():
    gen = torch.Generator().manual_seed(14)
    x = _acts((3, 2, 64), gen)
    p = cpu_int8.quantize_i8_convrot_cpu(x, 16)
    assert torch.equal(p, quantize_i8_convrot_reference(x, 16))
    wq, ws = quantize_weight_i8_reference(torch.randn(8, 64, generator=gen), 16)
    out = cpu_int8.linear_i8_cpu(x, wq, ws, x_kind="float", group=16)
    assert out.shape == (3, 2, 8)
    assert torch.equal(out, linear_i8_reference(x, wq, ws, x_kind="float", w_kind="int8",
                                                group=16))
    with pytest.raises(ValueError, match="x is not contiguous"):
        cpu_int8.quantize_i8_convrot_cpu(x.transpose(0, 1), 16)
    with pytest.raises(ValueError, match="K=64 and N=6 must be multiples of 4"):
        cpu_int8.linear_i8_cpu(x, wq[:6], ws[:6], x_kind="float", group=16)


def test_kernels_compile_at_plan_time():
    gen = torch.Generator().manual_seed(15)
    srcs, attrs = _linear_case("float", "float", True, 3, 16, 4, 4, gen, F16)
    g, _ = _graph(LINEAR, srcs, attrs)
    compiled(g).plan_for(srcs)
    quant, epi = cpu_int8._jit()
    assert any(str(sig[0]) == "array(uint16, 1d, C)" for sig in quant.signatures)
    assert any(str(sig[4]) == "array(uint16, 1d, C)" for sig in epi.signatures)


# -- torch.library ops ----------------------------------------------------------------------------

def test_library_ops_eagerly_run_the_references():
    gen = torch.Generator().manual_seed(16)
    x = _acts((2, 5, 64), gen)
    w = torch.randn(8, 64, generator=gen) * 0.05
    b = torch.randn(8, generator=gen)
    p = torch.ops.fxbackend.quantize_i8_convrot(x, 16)
    assert torch.equal(p, quantize_i8_convrot_reference(x, 16))
    out = torch.ops.fxbackend.linear_i8(p, w, None, None, b, "packed", "float", 16, 10, [2, 5])
    assert out.shape == (2, 5, 8)
    # a float weight on the CPU takes the codes this CPU's int8 kernels take, as compiled
    assert torch.equal(out, linear_i8_reference(x, w, bias=b, x_kind="float", w_kind="float",
                                                group=16,
                                                w_qmax=fxbackend.cpu.int8_weight_max()))
    with pytest.raises(ValueError, match="group must be one of"):
        torch.ops.fxbackend.quantize_i8_convrot(x, 8)


class _Tiny(torch.nn.Module):
    """A ConvRot block the way model code would call the ops: quantize once, two int8 linears
    reading the packed activations (one with a pre-quantized weight), one with a float
    weight and float activations."""

    def __init__(self, gen):
        super().__init__()
        self.w1 = torch.nn.Parameter(torch.randn(16, 64, generator=gen) * 0.05)
        self.b1 = torch.nn.Parameter(torch.randn(16, generator=gen))
        wq, ws = quantize_weight_i8_reference(torch.randn(32, 64, generator=gen) * 0.05, 16)
        self.register_buffer("w2", wq)
        self.register_buffer("w2_scale", ws)
        self.w3 = torch.nn.Parameter(torch.randn(8, 16, generator=gen) * 0.05)

    def forward(self, x):
        b, s, k = x.shape
        p = torch.ops.fxbackend.quantize_i8_convrot(x, 16)
        h = torch.ops.fxbackend.linear_i8(p, self.w1, None, None, self.b1, "packed", "float",
                                          16, b * s, [b, s])
        g = torch.ops.fxbackend.linear_i8(p, self.w2, self.w2_scale, None, None, "packed",
                                          "int8", 16, b * s, [b, s])
        y = torch.ops.fxbackend.linear_i8(torch.relu(h), self.w3, None, None, None, "float",
                                          "float", 4)
        return y, g.sum(-1)


def test_torch_compile_turns_library_calls_into_the_ops_and_kernels():
    gen = torch.Generator().manual_seed(17)
    model = _Tiny(gen)
    x = _acts((2, 5, 64), gen)
    with torch.no_grad():
        want = model(x)
        fn = torch.compile(model, backend="fxbackend", fullgraph=True)
        got = fn(x)
        stats = fxbackend.stats()
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
        assert stats["steps_by_kernel"].get("quantize_i8_convrot_cpu") == 1
        assert stats["steps_by_kernel"].get("linear_i8_cpu") == 3
        assert stats["rewrites_by_rule"].get("int8_library_ops") == 4
        model.w1.mul_(0.5)  # in place: the same plan's kernel re-quantizes it
        again = fn(x)
        assert fxbackend.stats()["plans_built"] == 1
        assert torch.equal(again[0], model(x)[0]) and not torch.equal(again[0], got[0])


def test_torch_compile_dynamic_shapes_rewrite_per_plan():
    """m and lead computed from symbolic sizes: each plan sees them concrete and rewrites."""
    gen = torch.Generator().manual_seed(18)
    model = _Tiny(gen)
    with torch.no_grad():
        fn = torch.compile(model, backend="fxbackend", dynamic=True, fullgraph=True)
        for s in (3, 6):
            x = _acts((2, s, 64), gen)
            got, want = fn(x), model(x)
            assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    assert fxbackend.stats()["steps_by_kernel"].get("linear_i8_cpu") == 6


# -- Triton kernels: the interpreter, metadata, compilation ----------------------------------------

def _interp_cases() -> list:
    cases = []
    for group in REGULAR_HADAMARD_GROUPS:
        for lead, k, block in [((1,), 256, None), ((5,), 768, None), ((2, 3), 512, 256),
                               ((3,), max(3 * group, 48), max(group, 16))]:
            if k % group:
                continue
            dtype = "bfloat16" if group == 16 else "float16" if group == 64 else "float32"
            cases.append({"kind": "quantize", "lead": list(lead), "k": k, "group": group,
                          "block": block, "dtype": dtype,
                          "id": f"quantize-g{group}-{'x'.join(map(str, lead))}x{k}-b{block}-"
                                f"{dtype}"})
    for group in (1, 16):
        cases.append({"kind": "quantize", "lead": [5], "k": 64, "group": group, "block": 32,
                      "dtype": "float32", "special": True, "id": f"quantize-special-g{group}"})
    for m, k, n in [(1, 4, 4), (5, 64, 12), (17, 256, 8)]:
        for x_kind in ("float", "packed", "int8"):
            for w_kind in ("int8", "float"):
                group = 16 if k % 16 == 0 else 4
                bias = (m + len(x_kind) + len(w_kind)) % 2 == 0
                cases.append({"kind": "linear", "m": m, "k": k, "n": n, "group": group,
                              "x_kind": x_kind, "w_kind": w_kind, "bias": bias,
                              "supported": m > 16 and k % 8 == 0 and n % 8 == 0,
                              "id": f"linear-{m}x{k}x{n}-g{group}-{x_kind}-{w_kind}-"
                                    f"{'bias' if bias else 'nobias'}"})
    cases.append({"kind": "linear", "m": 3, "k": 64, "n": 8, "group": 64, "x_kind": "float",
                  "w_kind": "float", "bias": True, "dtype": "bfloat16", "supported": False,
                  "id": "linear-bf16-3x64x8-g64"})
    cases.append({"kind": "requantize", "m": 5, "k": 64, "n": 8, "group": 16,
                  "id": "requantize-5x64x8-g16"})
    return cases


INTERP = _interp_cases()


@pytest.fixture(scope="module")
def interp_results():
    return run_checker("_int8_interp_check.py", INTERP)


@pytest.mark.parametrize("case", INTERP, ids=[c["id"] for c in INTERP])
def test_triton_kernels_in_the_interpreter(interp_results, case):
    check_result(interp_results, case)


def _cuda_node(m, k, n, x_kind="float", w_kind="int8", scale_shape=None):
    cuda = torch.device("cuda")
    g = Graph()

    def inp(shape, dtype):
        return g.append(g.new_node("input", meta=TensorMeta.contiguous(shape, dtype, cuda),
                                   is_input=True))
    x = inp((m, k), F32) if x_kind == "float" else inp((m, k), torch.int8)
    srcs = [x, inp((n, k), torch.int8 if w_kind == "int8" else F32)]
    if w_kind == "int8":
        srcs.append(inp(scale_shape or (n,), F32))
    if x_kind == "int8":
        srcs.append(inp((m,), F32))
    return fxbackend.op_create(g, LINEAR, srcs, {"x_kind": x_kind, "w_kind": w_kind,
                                                 "group": 4})


@pytest.mark.parametrize("m, k, n, reason", [
    (16, 64, 64, "M=16 rows: torch._int_mm on CUDA needs more than 16"),
    (17, 12, 64, "K=12 and N=64 must be multiples of 8"),
    (17, 64, 12, "K=64 and N=12 must be multiples of 8"),
    (17, 64, 64, None), (4096, 3072, 3072, None),
])
def test_cuda_linear_supports_on_metadata(m, k, n, reason):
    node = _cuda_node(m, k, n)
    why = cuda_int8.linear_why_not(node)
    assert why == reason if reason is None else why.startswith(reason)
    assert cuda_int8.linear_kernel.supports(node) is (reason is None)
    assert cuda_int8.float_weight_linear_kernel.supports(node) is False  # an int8 weight
    assert cuda_int8.linear_kernel.capture_safe
    assert not cuda_int8.float_weight_linear_kernel.capture_safe


def test_cuda_linear_declines_malformed_scales_and_cpu_tensors():
    assert "w_scale must be float32 [64]" in cuda_int8.linear_why_not(
        _cuda_node(32, 64, 64, scale_shape=(64, 1)))
    g, node = _graph(LINEAR, *_linear_case("float", "int8", False, 32, 64, 64, 4,
                                           torch.Generator().manual_seed(0)))
    assert "not the output's CUDA device" in cuda_int8.linear_why_not(node)


_COMPILED_ONLY = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") == "1",
                                    reason="compiled mode only")
_PTR = {F32: "*fp32", BF16: "*bf16", torch.int8: "*i8", torch.int32: "*i32"}


def _compile_sm90(kernel, ptrs: tuple, ints: dict, floats: dict, constexprs: dict,
                  num_warps: int):
    """The jitted kernel through Triton's ahead-of-time path to an sm_90 cubin (needs ptxas,
    not a GPU); as tests/_rope_interp_check.aot_compile, with int8/int32 pointers."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    names = kernel.arg_names
    sig = {name: _PTR[dt] for name, dt in zip(names, ptrs)}
    sig.update({name: "i32" for name in ints})
    sig.update({name: "fp32" for name in floats})
    sig.update({name: "constexpr" for name in constexprs})
    src = ASTSource(kernel, sig, constexprs=constexprs,
                    attrs={(i,): [["tt.divisibility", 16]] for i in range(len(ptrs))})
    return triton.compile(src, target=GPUTarget("cuda", 90, 32),
                          options={"num_warps": num_warps, "enable_fp_fusion": False})


@_COMPILED_ONLY
def test_triton_kernels_compile_for_sm90_without_a_gpu():
    ck = _compile_sm90(cuda_int8._quantize(), (BF16, torch.int8, F32), {"M": 0, "K": 0},
                       {"inv": 0}, {"NST": 4, "BLOCK": 1024, "ONE_PASS": False}, 4)
    ptx = ck.asm["ptx"]
    assert ck.asm.get("cubin") and "div.rn.f32" in ptx and "div.full" not in ptx
    ck = _compile_sm90(cuda_int8._epilogue(), (torch.int32, F32, F32, F32, F32),
                       {"M": 0, "N": 0}, {}, {"HAS_BIAS": True, "BLOCK_M": 32,
                                              "BLOCK_N": 128}, 4)
    assert ck.asm.get("cubin") and "fma" not in ck.asm["ptx"]


# -- on a GPU: real sizes --------------------------------------------------------------------------

@pytest.mark.cuda
@pytest.mark.parametrize("group", [1, 256])
@pytest.mark.parametrize("x_kind, w_kind", [("float", "int8"), ("packed", "float"),
                                            ("int8", "int8")])
def test_cuda_linear_at_real_sizes(group, x_kind, w_kind):
    gen = torch.Generator().manual_seed(group)
    srcs, attrs = _linear_case(x_kind, w_kind, True, 1024, 3072, 3072, group, gen)
    srcs = [t.cuda() for t in srcs]
    g, _ = _graph(LINEAR, srcs, attrs)
    fxbackend.reset_stats()
    (out,) = compiled(g)(*srcs)
    want_kernel = "linear_i8_triton" if w_kind == "int8" else "linear_i8_triton_float_weight"
    assert dict(fxbackend.stats()["steps_by_kernel"]) == {want_kernel: 1}
    assert torch.equal(out, _reference(srcs, attrs))


@pytest.mark.cuda
@pytest.mark.parametrize("group", REGULAR_HADAMARD_GROUPS)
@pytest.mark.parametrize("dtype", [F32, BF16])
def test_cuda_quantize_at_real_sizes(group, dtype):
    x = _acts((4096, 3072), torch.Generator().manual_seed(group), dtype).cuda()
    out, steps = _run(QUANT, [x], {"group": group})
    assert steps == {"quantize_i8_convrot_triton": 1}
    assert torch.equal(out, quantize_i8_convrot_reference(x, group))
    long_rows = _acts((64, 12288), torch.Generator().manual_seed(1), dtype).cuda()
    assert torch.equal(cuda_int8.quantize_i8_convrot_triton(long_rows, group),
                       quantize_i8_convrot_reference(long_rows, group))


@pytest.mark.cuda
def test_cuda_linear_small_m_falls_back_to_the_reference():
    gen = torch.Generator().manual_seed(2)
    srcs, attrs = _linear_case("float", "int8", True, 5, 64, 64, 16, gen)
    srcs = [t.cuda() for t in srcs]
    g, _ = _graph(LINEAR, srcs, attrs)
    fxbackend.reset_stats()
    (out,) = compiled(g)(*srcs)
    assert dict(fxbackend.stats()["steps_by_kernel"]) == {"native": 1}
    assert torch.equal(out.cpu(), _reference([t.cpu() for t in srcs], attrs))


def test_weight_state_follows_the_weight_object_group_and_variant():
    """``WeightState.get`` keeps the cell of its last call: a call with another weight object,
    group or quantizer variant takes that one's own value, and a ``.data`` write is seen."""
    calls = []
    variant = [1]

    def quantize(w, group, w_i8, w_scale):
        calls.append((group, variant[0]))
        w_i8.fill_(len(calls))
        w_scale.fill_(1.0)
    quantize.variant = lambda: variant[0]

    st = I.WeightState(4, 8, torch.device("cpu"))
    w = torch.randn(4, 8)
    first = st.get(w, 1, quantize)
    assert st.get(w, 1, quantize)[0] is first[0] and len(calls) == 1
    other = w.clone()  # equal bytes, another object: a value of its own
    assert int(st.get(other, 1, quantize)[0][0, 0]) == 2
    assert st.get(w, 1, quantize)[0] is first[0] and len(calls) == 2
    assert int(st.get(w, 4, quantize)[0][0, 0]) == 3  # another group
    variant[0] = 2
    assert int(st.get(w, 1, quantize)[0][0, 0]) == 4 and calls[-1] == (1, 2)
    variant[0] = 1
    assert st.get(w, 1, quantize)[0] is first[0] and len(calls) == 4
    w.data.mul_(2)  # not seen by the version counter, seen by the fingerprint
    assert int(st.get(w, 1, quantize)[0][0, 0]) == 5 and st.quantized == 5
