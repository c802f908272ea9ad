"""The Triton RoPE kernel (cuda_kernels/rope.py) for ``sd.rope_apply.v1``.

- interpreter checks, no GPU needed: the kernel runs in Triton's interpreter on CPU tensors, in a
  subprocess (``TRITON_INTERPRET=1`` must be set before Triton is imported, and other tests in
  this process may import it first; see tests/_rope_interp_check.py), against ``rope_reference``
  over both modes, full/partial/wide rotation, odd shapes, strided rows and broadcast tables;
- ``supports`` and the launch layout on metadata alone (no device, no Triton);
- ``cuda``-marked checks at real model sizes through ``CompiledGraph`` (skipped without a GPU),
  with achieved GB/s printed next to the eager reference.
"""
from __future__ import annotations

import os
import subprocess
import sys

import pytest
import sympy
import torch

import fxbackend
from fxbackend import Graph, TensorMeta, registry
from fxbackend.cuda_kernels import rope as cuda_rope
from fxbackend.cuda_kernels.rope import RopeApplyCUDA, rope_apply_triton
from fxbackend.patterns.rope import rope_reference

import _rope_interp_check as interp
from ext_util import compiled, contiguous_strides, registry_guard, set_outputs  # noqa: F401

OP = "sd.rope_apply.v1"
CUDA = torch.device("cuda")

# (dtype, atol, rtol)
DTYPES = [
    (torch.float32, 1e-6, 1e-5),
    (torch.bfloat16, 1e-2, 1e-2),
    (torch.float16, 1e-3, 1e-3),
]
MODES = ["interleaved", "split_half"]
# (name, D, n_rot): odd row counts everywhere (B=2, S=7, H=3); "wide" spans several programs
# with a partial last block of rows
ROTATIONS = [("full", 6, 6), ("partial", 10, 6), ("wide", 130, 128)]


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _interp_cases() -> list:
    cases = []
    for layout in interp.LAYOUTS:
        for mode in MODES:
            for rot, d, n_rot in ROTATIONS:
                for dtype, atol, rtol in DTYPES:
                    cases.append({"id": f"{layout}-{mode}-{rot}-{_dtype_name(dtype)}",
                                  "layout": layout, "d": d, "n_rot": n_rot, "mode": mode,
                                  "dtype": _dtype_name(dtype), "atol": atol, "rtol": rtol,
                                  "via": "launcher"})
            # the registry kernel's prepare + execute path (state from metadata)
            dtype, atol, rtol = DTYPES[0]
            cases.append({"id": f"{layout}-{mode}-partial-float32-execute", "layout": layout,
                          "d": 10, "n_rot": 6, "mode": mode, "dtype": "float32", "atol": atol,
                          "rtol": rtol, "via": "execute"})
    # sd.rope_apply_rounded.v1 (each product rounded to x's dtype): bit for bit, 16-bit tables
    # and float32 ones, through the launcher and the registry kernel
    for layout in ("bhsd_cos_s", "qkv_slice_bshd", "cos_strided_f32"):
        for mode in MODES:
            for dtype in ("bfloat16", "float16"):
                for via in ("launcher", "execute"):
                    cases.append({"id": f"{layout}-{mode}-partial-{dtype}-rounded-{via}",
                                  "layout": layout, "d": 10, "n_rot": 6, "mode": mode,
                                  "dtype": dtype, "atol": 0.0, "rtol": 0.0, "via": via,
                                  "rounding": "each_op"})
    return cases


INTERP_CASES = _interp_cases()


# -- Triton's interpreter on CPU tensors --------------------------------------------------------

@pytest.fixture(scope="module")
def interp_results() -> dict:
    """Runs every interpreter case in one subprocess (one Triton import); results by id."""
    return interp.run_checker("_rope_interp_check.py", INTERP_CASES)


@pytest.mark.parametrize("case", INTERP_CASES, ids=[c["id"] for c in INTERP_CASES])
def test_interpreter_matches_the_reference(interp_results, case):
    interp.check_result(interp_results, case)


# -- registration and import cost ---------------------------------------------------------------

def test_the_kernel_is_registered_for_cuda():
    names = [k.name for k in registry.kernels_for("cuda", OP)]
    assert "rope_apply_triton" in names
    assert "rope_apply_triton" not in [k.name for k in registry.kernels_for("cpu", OP)]


def test_importing_fxbackend_does_not_import_triton():
    """Nor does importing any of the Triton kernel modules (rmsnorm's and rms_rope's too)."""
    code = ("import sys, fxbackend, fxbackend.cuda_kernels.rope, fxbackend.cuda_kernels.rmsnorm, "
            "fxbackend.cuda_kernels.rms_rope; sys.exit(1 if 'triton' in sys.modules else 0)")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    assert subprocess.run([sys.executable, "-c", code], env=env, timeout=120).returncode == 0


# -- supports() on metadata (no device needed) --------------------------------------------------

def _meta(shape, dtype=torch.float32, device=CUDA, stride=None, offset=0) -> TensorMeta:
    shape = tuple(shape)
    return TensorMeta(shape, tuple(stride) if stride is not None else contiguous_strides(shape),
                      dtype, device, offset)


def _node(x: TensorMeta, cos: TensorMeta, sin: TensorMeta | None = None, mode="interleaved",
          n_rot: int | None = None, infer: bool = True):
    """A rope node over three graph inputs; ``infer=False`` bypasses the op's validation (to
    ask ``supports`` about nodes the op would reject)."""
    g = Graph()
    srcs = [g.append(g.new_node("input", meta=m, is_input=True)) for m in (x, cos, sin or cos)]
    attrs = {"mode": mode, "n_rot": x.shape[-1] if n_rot is None else n_rot}
    if infer:
        return fxbackend.op_create(g, OP, srcs, attrs)
    out = _meta(x.shape, x.dtype, x.device)
    return g.append(g.new_node(OP, srcs, attrs, out))


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("dtype", [d for d, _, _ in DTYPES])
def test_supports_cuda_metadata(dtype, mode):
    k = RopeApplyCUDA()
    assert k.supports(_node(_meta((1, 24, 4096, 128), dtype), _meta((4096, 128)), mode=mode))
    assert k.supports(_node(_meta((2, 7, 3, 10), dtype), _meta((7, 1, 6), dtype), mode=mode,
                            n_rot=6))


def test_supports_strided_rows_and_other_devices_of_the_same_type():
    k = RopeApplyCUDA()
    b, s, h, d = 2, 7, 3, 8
    # k of a fused [B,S,3*H*D] projection, seen as [B,H,S,D]
    x = _meta((b, h, s, d), stride=(s * 3 * h * d, d, 3 * h * d, 1), offset=h * d)
    assert k.supports(_node(x, _meta((s, d))))
    dev1 = torch.device("cuda:1")
    assert k.supports(_node(_meta((s, d), device=dev1), _meta((s, d), device=dev1)))


#: five leading dims no two of which merge (each stride twice what contiguity needs)
_GAPPED = ((2, 2, 2, 2, 2, 4), (1024, 256, 64, 16, 4, 1))


@pytest.mark.parametrize("why, node", [
    ("cpu", lambda: _node(_meta((2, 4, 8), device=torch.device("cpu")),
                          _meta((4, 8), device=torch.device("cpu")))),
    ("float64 x", lambda: _node(_meta((2, 4, 8), torch.float64), _meta((4, 8)))),
    ("float64 cos", lambda: _node(_meta((2, 4, 8)), _meta((4, 8), torch.float64))),
    ("last stride 2", lambda: _node(_meta((2, 4, 8), stride=(64, 16, 2)), _meta((4, 8)),
                                    infer=False)),
    ("cos on another device", lambda: _node(_meta((2, 4, 8)),
                                            _meta((4, 8), device=torch.device("cpu")))),
    ("head over MAX_D", lambda: _node(_meta((2, 2 * cuda_rope.MAX_D)),
                                      _meta((2, 2 * cuda_rope.MAX_D)))),
    ("five unmergeable leading dims", lambda: _node(_meta(_GAPPED[0], stride=_GAPPED[1]),
                                                    _meta(_GAPPED[0]))),
    ("symbolic shape", lambda: _node(_meta((sympy.Symbol("s0"), 8), stride=(8, 1)),
                                     _meta((sympy.Symbol("s0"), 8), stride=(8, 1)), infer=False)),
    ("unknown mode", lambda: _node(_meta((4, 8)), _meta((4, 8)), mode="half", infer=False)),
    ("odd n_rot", lambda: _node(_meta((4, 8)), _meta((4, 3)), n_rot=3, infer=False)),
    ("cos not broadcastable", lambda: _node(_meta((4, 8)), _meta((5, 8)), infer=False)),
])
def test_supports_declines_without_raising(why, node):
    assert RopeApplyCUDA().supports(node()) is False, why


def test_supports_never_raises_on_malformed_nodes():
    k = RopeApplyCUDA()
    n = _node(_meta((4, 8)), _meta((4, 8)))
    n.params = {}
    assert k.supports(n) is False
    n = _node(_meta((4, 8)), _meta((4, 8)))
    n.srcs = n.srcs[:2]
    assert k.supports(n) is False
    n = _node(_meta((4, 8)), _meta((4, 8)))
    n.srcs[1].meta = None
    assert k.supports(n) is False


# -- the launch layout (pure Python) ------------------------------------------------------------

def _layout(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, n_rot: int):
    """(sizes, x strides, cos strides, sin strides) of the merged leading dims, without the
    padding to MAX_LEAD_DIMS."""
    p = cuda_rope._plan_of_tensors(x, cos, sin, "interleaved", n_rot)
    n_rows, _, _, s1, s2, s3, *rest = p.args
    xs, cs, ss = rest[0:4], rest[4:8], rest[8:12]
    sizes = [n_rows // (s1 * s2 * s3), s1, s2, s3]
    keep = [i for i in range(4) if sizes[i] != 1 or xs[i] or cs[i] or ss[i]]
    return ([sizes[i] for i in keep], [xs[i] for i in keep], [cs[i] for i in keep],
            [ss[i] for i in keep])


def test_layout_merges_dims_and_broadcasts_tables_with_stride_zero():
    b, h, s, d = 2, 3, 7, 8
    x = torch.empty(b, h, s, d)
    table = torch.empty(s, d)
    # [B,H,S,D] against [S, D]: B and H merge into one dim the table does not step over
    assert _layout(x, table, table, d) == ([b * h, s], [s * d, d], [0, d], [0, d])
    # one table row per row of x: everything merges into one dim, the [R, D] view
    rows = torch.empty(b, h, s, d)
    assert _layout(x, rows, rows, d) == ([b * h * s], [d], [d], [d])
    # k of a fused QKV projection seen as [B,H,S,D], against a [1,1,S,D] table
    qkv = torch.empty(b, s, 3 * h * d).view(b, s, 3, h, d)[:, :, 1].transpose(1, 2)
    t4 = torch.empty(1, 1, s, d)
    assert _layout(qkv, t4, t4, d) == ([b, h, s], [s * 3 * h * d, d, 3 * h * d], [0, 0, d],
                                       [0, 0, d])
    p = cuda_rope._plan_of_tensors(x, table[:, :1], table, "split_half", d)
    assert p.args[-2:] == (0, 1), "a feature-broadcast cos has feature stride 0"


def test_block_sizes_cover_the_head_and_the_grid_covers_the_rows():
    p = cuda_rope._plan_of_tensors(torch.empty(1, 24, 4096, 128), torch.empty(4096, 128),
                                   torch.empty(4096, 128), "interleaved", 128)
    assert p.block_d == 128 and p.block_r * p.block_d == cuda_rope.TILE
    assert p.grid == (24 * 4096 // p.block_r,)
    p = cuda_rope._plan_of_tensors(torch.empty(3, 130), torch.empty(3, 128), torch.empty(3, 128),
                                   "interleaved", 128)
    assert (p.block_d, p.block_r, p.grid) == (256, 4, (1,))
    p = cuda_rope._plan_of_tensors(torch.empty(0, 8), torch.empty(8), torch.empty(8),
                                   "interleaved", 8)
    assert p.grid == (0,), "nothing to launch for no rows"


def test_prepare_plans_from_metadata_and_execute_replans_for_other_strides():
    x = torch.empty(2, 7, 3, 8).transpose(1, 2)
    cos = torch.empty(7, 8)
    n = _node(TensorMeta.of(x), TensorMeta.of(cos), TensorMeta.of(cos))
    state, ws = RopeApplyCUDA().prepare(n)
    assert ws == 0 and len(state.launches) == 1
    assert state.get(x, cos, cos, "interleaved", 8) is next(iter(state.launches.values()))
    assert len(state.launches) == 1, "the tensors match the metadata: no re-plan"
    other = state.get(x.contiguous(), cos, cos, "interleaved", 8)
    assert len(state.launches) == 2
    assert other == cuda_rope._plan_of_tensors(x.contiguous(), cos, cos, "interleaved", 8)


@pytest.mark.parametrize("why, args", [
    ("float64", lambda: (torch.zeros(4, 8, dtype=torch.float64), torch.zeros(4, 8),
                         torch.zeros(4, 8), "interleaved", 8, torch.zeros(4, 8))),
    ("out not contiguous", lambda: (torch.zeros(4, 8), torch.zeros(4, 8), torch.zeros(4, 8),
                                    "interleaved", 8, torch.zeros(8, 4).t())),
    ("last stride 2", lambda: (torch.zeros(4, 16)[:, ::2], torch.zeros(4, 8), torch.zeros(4, 8),
                               "interleaved", 8, torch.zeros(4, 8))),
    ("five unmergeable leading dims", lambda: (
        torch.zeros(4096).as_strided(*_GAPPED), torch.zeros(4), torch.zeros(4), "interleaved", 4,
        torch.zeros(_GAPPED[0]))),
    ("mode", lambda: (torch.zeros(4, 8), torch.zeros(4, 8), torch.zeros(4, 8), "neox", 8,
                      torch.zeros(4, 8))),
])
def test_the_launcher_rejects_what_the_kernel_does_not_take(why, args):
    with pytest.raises(ValueError):
        rope_apply_triton(*args())


def test_compile_is_a_no_op_off_cuda():
    n = _node(_meta((4, 8), device=torch.device("cpu")), _meta((4, 8), device=torch.device("cpu")))
    assert RopeApplyCUDA().compile(n) is None


# -- compiled mode without a GPU: Triton's ahead-of-time path down to an sm_90 cubin ------------

@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") == "1", reason="compiled mode only")
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("dtypes,each_op", [
    ((torch.bfloat16, torch.float32, torch.float32, torch.bfloat16), False),
    ((torch.float32,) * 4, False), ((torch.float16,) * 4, False),
    ((torch.bfloat16,) * 4, True), ((torch.float16,) * 4, True)],
    ids=["bf16-f32tables", "fp32", "fp16", "bf16-rounded", "fp16-rounded"])
def test_the_kernel_compiles_for_sm90_without_a_gpu(mode, dtypes, each_op):
    """Catches what the interpreter does not check (types, constexpr handling, lowering)."""
    x = torch.empty(2, 7, 3, 128).transpose(1, 2)  # strided rows: three leading dims
    p = cuda_rope._plan_of_tensors(x, torch.empty(7, 128), torch.empty(7, 128), mode, 128)
    ck = interp.aot_compile(cuda_rope._kernel(), dtypes, p.args,
                            {"INTERLEAVED": p.interleaved, "BLOCK_R": p.block_r,
                             "BLOCK_D": p.block_d, "EACH_OP": each_op},
                            {"num_warps": cuda_rope.NUM_WARPS})
    assert ck.asm.get("cubin"), "no cubin"


# -- on a GPU: real model sizes through CompiledGraph -------------------------------------------

# (name, B, H, S, D, n_rot, mode, layout of x, shape of the cos/sin tables)
CUDA_CONFIGS = [
    ("flux", 1, 24, 4096, 128, 128, "interleaved", "bhsd", (4096, 128)),
    ("sd3_like", 2, 24, 4096, 64, 64, "split_half", "bshd", (4096, 1, 64)),
    ("partial_qkv", 2, 16, 1024, 128, 64, "interleaved", "qkv_bhsd", (1, 1, 1024, 64)),
]
CUDA_DTYPES = [(torch.bfloat16, 1e-2, 1e-2), (torch.float32, 1e-6, 1e-5)]


def _cuda_inputs(cfg, dtype):
    name, b, h, s, d, n_rot, mode, layout, table = cfg
    g = torch.Generator(device="cuda").manual_seed(0)
    if layout == "bhsd":
        x = torch.randn(b, h, s, d, device="cuda", dtype=dtype, generator=g)
    elif layout == "bshd":
        x = torch.randn(b, s, h, d, device="cuda", dtype=dtype, generator=g)
    else:  # k of a fused QKV projection as [B,H,S,D]
        qkv = torch.randn(b, s, 3 * h * d, device="cuda", dtype=dtype, generator=g)
        x = qkv.view(b, s, 3, h, d)[:, :, 1].transpose(1, 2)
    ang = torch.rand(*table, device="cuda", generator=g) * 6.28  # float32 tables, as in Flux
    return x, ang.cos(), ang.sin(), mode, n_rot


def _time_ms(fn, iters: int = 20) -> float:
    fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / iters


@pytest.mark.cuda
@pytest.mark.usefixtures("registry_guard")
@pytest.mark.parametrize("dtype, atol, rtol", CUDA_DTYPES, ids=["bf16", "fp32"])
@pytest.mark.parametrize("cfg", CUDA_CONFIGS, ids=[c[0] for c in CUDA_CONFIGS])
def test_cuda_graph_matches_the_reference(cfg, dtype, atol, rtol):
    x, cos, sin, mode, n_rot = _cuda_inputs(cfg, dtype)
    g = Graph()
    srcs = [g.append(g.new_node("input", meta=TensorMeta.of(t), is_input=True))
            for t in (x, cos, sin)]
    set_outputs(g, fxbackend.op_create(g, OP, srcs, {"mode": mode, "n_rot": n_rot}))
    cg = compiled(g)
    (out,) = cg(x, cos, sin)
    want = rope_reference(x, cos, sin, mode, n_rot)
    torch.testing.assert_close(out, want, atol=atol, rtol=rtol)
    assert torch.equal(out[..., n_rot:], x[..., n_rot:])
    assert fxbackend.stats()["steps_by_kernel"].get("rope_apply_triton") == 1

    # achieved bandwidth, for information (x read, out written, the tables read once)
    out2 = torch.empty_like(out)
    nbytes = 2 * x.numel() * x.element_size() + 2 * cos.numel() * cos.element_size()
    ms = _time_ms(lambda: rope_apply_triton(x, cos, sin, mode, n_rot, out2))
    ms_eager = _time_ms(lambda: rope_reference(x, cos, sin, mode, n_rot))
    print(f"\n[rope cuda] {cfg[0]} {dtype}: triton {ms * 1e3:.1f} us "
          f"({nbytes / ms / 1e6:.0f} GB/s), eager reference {ms_eager * 1e3:.1f} us "
          f"({nbytes / ms_eager / 1e6:.0f} GB/s)")


@pytest.mark.cuda
def test_cuda_launches_on_the_current_stream():
    x, cos, sin, mode, n_rot = _cuda_inputs(CUDA_CONFIGS[0], torch.bfloat16)
    out = torch.empty(x.shape, dtype=x.dtype, device="cuda")
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        rope_apply_triton(x, cos, sin, mode, n_rot, out)
    side.synchronize()
    torch.testing.assert_close(out, rope_reference(x, cos, sin, mode, n_rot), atol=1e-2,
                               rtol=1e-2)


@pytest.mark.cuda
@pytest.mark.usefixtures("registry_guard")
def test_cuda_compile_warms_the_kernel_then_runs():
    x, cos, sin, mode, n_rot = _cuda_inputs(CUDA_CONFIGS[1], torch.float16)
    n = _node(TensorMeta.of(x), TensorMeta.of(cos), TensorMeta.of(sin), mode=mode, n_rot=n_rot)
    k = RopeApplyCUDA()
    assert k.supports(n)
    k.compile(n)
    state, _ = k.prepare(n)
    out = torch.empty(x.shape, dtype=x.dtype, device="cuda")
    k.execute(fxbackend.ExecContext(x.device), n, state, [x, cos, sin], out, None)
    torch.testing.assert_close(out, rope_reference(x, cos, sin, mode, n_rot), atol=1e-3,
                               rtol=1e-3)


@pytest.mark.cuda
@pytest.mark.usefixtures("registry_guard")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_cuda_rounded_op_is_the_16bit_chain_bit_for_bit(dtype):
    """``sd.rope_apply_rounded.v1`` at Wan's size ([1, 4096, 12, 128], 16-bit tables) through a
    plan: the same bits as torch's 16-bit ops on the GPU (x1 * c - x2 * s, x1 * s + x2 * c)."""
    g_ = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(1, 4096, 12, 128, device="cuda", generator=g_).to(dtype)
    ang = torch.rand(1, 4096, 1, 64, device="cuda", generator=g_) * 6.28
    c, s = ang.cos().to(dtype), ang.sin().to(dtype)
    cos, sin = (t.unsqueeze(-1).expand(1, 4096, 1, 64, 2).reshape(1, 4096, 1, 128)
                for t in (c, s))
    g = Graph()
    srcs = [g.append(g.new_node("input", meta=TensorMeta.of(t), is_input=True))
            for t in (x, cos, sin)]
    set_outputs(g, fxbackend.op_create(g, "sd.rope_apply_rounded.v1", srcs,
                                       {"mode": "interleaved", "n_rot": 128}))
    (out,) = compiled(g)(x, cos, sin)
    assert fxbackend.stats()["steps_by_kernel"].get("rope_apply_rounded_triton") == 1
    x1, x2 = x.unflatten(-1, (-1, 2)).unbind(-1)
    want = torch.empty_like(x)
    want[..., 0::2] = x1 * c - x2 * s
    want[..., 1::2] = x1 * s + x2 * c
    assert torch.equal(out, want)
