"""The fused RMSNorm -> RoPE [-> * scale] Triton kernel (cuda_kernels/rms_rope.py) and the RMSNorm
Triton kernel for ``sd.rms_norm.v1`` (cuda_kernels/rmsnorm.py).

- interpreter checks, no GPU needed: both kernels run in Triton's interpreter on CPU tensors in a
  subprocess (tests/_rms_rope_interp_check.py, which also makes the interpreter's bf16 rounding
  that of a GPU), against ``rms_rope_reference`` / ``rms_norm_reference``: both modes, full and
  partial rotation, rows 1 and 7, D 6/18/130, strided rows, broadcast cos/sin, with and without a
  scale, out's dtype equal to Tn or not, dtype rows with tolerances of one unit in the last place
  of the coarser of Tn and out's dtype, and at least 99% of 16-bit outputs bit-equal;
- ``why_not`` / ``supports`` and the launch layout on metadata alone (no device, no Triton);
- compiled mode without a GPU: both kernels through Triton's ahead-of-time path to an sm_90
  cubin;
- ``cuda``-marked checks at real sizes (skipped without a GPU), and the bandwidth measurement of
  scripts/bench_rms_rope_cuda.py.
"""
from __future__ import annotations

import importlib.util
import os
import pathlib
import subprocess
import sys

import pytest
import sympy
import torch

import fxbackend
from fxbackend import Graph, TensorMeta, registry
from fxbackend.cuda_kernels import rms_rope as fused
from fxbackend.cuda_kernels import rmsnorm as cuda_rms
from fxbackend.cuda_kernels import rope as cuda_rope
from fxbackend.cuda_kernels.rms_rope import rms_rope_triton, why_not
from fxbackend.cuda_kernels.rmsnorm import RmsNormCUDA, rms_norm_triton
from fxbackend.patterns.rmsnorm import rms_norm_out_dtype, rms_norm_reference
from fxbackend.patterns.rope import rms_rope_reference

import _rope_interp_check as interp
from ext_util import compiled, contiguous_strides, registry_guard, set_outputs  # noqa: F401

OP = "sd.rms_norm.v1"
CUDA = torch.device("cuda")
HERE = pathlib.Path(__file__).parent
MODES = ["interleaved", "split_half"]
F32, BF16, F16 = torch.float32, torch.bfloat16, torch.float16
#: one unit in the last place at magnitude 1 (the relative ulp is at most this):
#: (atol, rtol) per dtype; float32 as the brief asks
ULP = {F32: (1e-5, 1e-5), BF16: (2.0**-7, 2.0**-7), F16: (2.0**-10, 2.0**-10)}
#: x, weight dtype rows (Tn is the weight's dtype)
DTYPE_ROWS = [(F32, F32), (BF16, BF16), (F16, F16)]
SCALE = 128 ** -0.5  # attention's 1/sqrt(head size): not a power of two, so it rounds


def _name(dtype) -> str | None:
    return None if dtype is None else str(dtype).removeprefix("torch.")


def _tol(*dtypes) -> dict:
    """Tolerance of one ulp of the coarsest dtype, and how much must be bit-equal."""
    coarse = max(dtypes, key=lambda d: ULP[d][0])
    atol, rtol = ULP[coarse]
    return {"atol": atol, "rtol": rtol, "min_exact": 0.0 if coarse == F32 else 0.99}


# (layout, rows, D, n_rot): odd shapes; "bshd_as_bhsd" at D=130 spans six programs with a partial
# last block of rows (block 8 x 256)
GEOMETRIES = [("rows", 1, 6, 6), ("rows", 7, 18, 10), ("qkv_bhsd", 0, 18, 18),
              ("bshd_as_bhsd", 0, 130, 64)]


def _rms_rope_cases() -> list:
    cases = []

    def add(tag, layout, rows, d, n_rot, mode, x, w, cs, out, scale, w_strided=False):
        cases.append({"kind": "rms_rope", "layout": layout, "rows": rows, "d": d,
                      "n_rot": n_rot, "mode": mode, "x": _name(x), "w": _name(w),
                      "cs": _name(cs), "out": _name(out), "scale": scale,
                      "w_strided": w_strided, **_tol(w, out),
                      "id": f"rms_rope-{tag}-{layout}{rows or ''}-d{d}r{n_rot}-{mode}-"
                            f"{_name(x)}.{_name(w)}-cs_{_name(cs)}-out_{_name(out)}"
                            f"{'-scale' if scale else ''}"})

    for x, w in DTYPE_ROWS:
        other = F32 if w != F32 else BF16
        for mode in MODES:
            for i, (layout, rows, d, n_rot) in enumerate(GEOMETRIES):
                # alternate: cos/sin float32 or Tn, out Tn or another dtype, scale or not
                add("row", layout, rows, d, n_rot, mode, x, w, F32 if i % 2 == 0 else w,
                    w if i in (0, 3) else other, SCALE if i in (1, 3) else None)
    # mixed rows: bf16 x with a float32 weight (Tn float32), [B,S,H,D] against [S,1,n];
    # float32 x with a bf16 weight (Tn bf16, read through a stride of 2)
    for mode in MODES:
        add("mixed", "bshd_s1", 0, 18, 10, mode, BF16, F32, F32, BF16, SCALE)
        add("mixed", "qkv_bhsd", 0, 18, 18, mode, F32, BF16, BF16, F32, None, w_strided=True)
    return cases


def _rms_norm_cases() -> list:
    cases = []
    # (layout, rows, D): D=1 (a constexpr after Triton's specialisation), odd D, strided rows,
    # several programs
    geoms = [("rows", 1, 1), ("rows", 7, 17), ("qkv_bhsd", 0, 6), ("bshd_as_bhsd", 0, 130)]
    rows = [(F32, None), (BF16, None), (F16, None), (F32, F32), (BF16, BF16), (F16, F16),
            (BF16, F32), (F32, BF16)]
    for i, (x, w) in enumerate(rows):
        for j, (layout, r, d) in enumerate(geoms):
            if (i + j) % 2:  # half of the grid keeps the run short
                continue
            out = rms_norm_out_dtype(x, w)
            cases.append({"kind": "rms_norm", "layout": layout, "rows": r, "d": d,
                          "x": _name(x), "w": _name(w), "via": "launcher",
                          "w_strided": j == 2, **_tol(out),
                          "id": f"rms_norm-{layout}{r or ''}-d{d}-{_name(x)}.{_name(w)}"})
    for x, w in ((BF16, BF16), (F16, None)):  # the registry kernel's prepare + execute
        cases.append({"kind": "rms_norm", "layout": "qkv_bhsd", "rows": 0, "d": 18,
                      "x": _name(x), "w": _name(w), "via": "execute",
                      **_tol(rms_norm_out_dtype(x, w)),
                      "id": f"rms_norm-execute-{_name(x)}.{_name(w)}"})
    return cases


INTERP_CASES = _rms_rope_cases() + _rms_norm_cases()


# -- Triton's interpreter on CPU tensors --------------------------------------------------------

@pytest.fixture(scope="module")
def interp_results() -> dict:
    """Runs every interpreter case in one subprocess (one Triton import); results by id."""
    return interp.run_checker("_rms_rope_interp_check.py", INTERP_CASES)


def test_case_ids_are_unique():
    assert len({c["id"] for c in INTERP_CASES}) == len(INTERP_CASES)


@pytest.mark.parametrize("case", INTERP_CASES, ids=[c["id"] for c in INTERP_CASES])
def test_interpreter_matches_the_reference(interp_results, case):
    interp.check_result(interp_results, case)


# -- registration -------------------------------------------------------------------------------
# (that importing these modules does not import Triton is tested in tests/test_rope_cuda.py)

def test_the_rms_norm_kernel_is_registered_for_cuda_only():
    assert "rms_norm_triton" in [k.name for k in registry.kernels_for("cuda", OP)]
    assert "rms_norm_triton" not in [k.name for k in registry.kernels_for("cpu", OP)]


def test_the_fused_module_registers_nothing():
    assert [k.name for k in registry.kernels_for("cuda", "sd.rope_apply.v1")] == \
        ["rope_apply_triton"]


# -- metadata: why_not and supports (no device needed) ------------------------------------------

def _meta(shape, dtype=F32, device=CUDA, stride=None, offset=0) -> TensorMeta:
    shape = tuple(shape)
    return TensorMeta(shape, tuple(stride) if stride is not None else contiguous_strides(shape),
                      dtype, device, offset)


#: five leading dims no two of which merge (each stride twice what contiguity needs)
_GAPPED = ((2, 2, 2, 2, 2, 4), (1024, 256, 64, 16, 4, 1))
_QKV = dict(shape=(2, 24, 4096, 128), stride=(4096 * 3 * 24 * 128, 128, 3 * 24 * 128, 1))


@pytest.mark.parametrize("x, w", DTYPE_ROWS + [(BF16, F32)], ids=lambda d: _name(d))
@pytest.mark.parametrize("mode", MODES)
def test_why_not_accepts_real_layouts(x, w, mode):
    d = 128
    assert why_not(_meta((1, 4096, 24, d), x), _meta((d,), w), _meta((4096, 1, d)),
                   _meta((4096, 1, d)), w, mode, d) is None
    assert why_not(_meta(_QKV["shape"], x, stride=_QKV["stride"]), _meta((d,), w),
                   _meta((1, 1, 4096, 64), w), _meta((4096, 64)), F32, mode, 64) is None
    dev1 = torch.device("cuda:1")
    assert why_not(*(_meta(s, x, device=dev1) for s in ((7, 18), (18,), (7, 10), (7, 10))),
                   BF16, mode, 10) is None


_CPU = torch.device("cpu")


@pytest.mark.parametrize("why, args", [
    ("cpu", lambda: (_meta((4, 8), device=_CPU), _meta((8,), device=_CPU),
                     _meta((4, 8), device=_CPU), _meta((4, 8), device=_CPU), F32, "interleaved",
                     8)),
    ("weight on another device", lambda: (_meta((4, 8)), _meta((8,), device=_CPU), _meta((4, 8)),
                                          _meta((4, 8)), F32, "interleaved", 8)),
    ("float64 x", lambda: (_meta((4, 8), torch.float64), _meta((8,)), _meta((4, 8)),
                           _meta((4, 8)), F32, "interleaved", 8)),
    ("float64 out", lambda: (_meta((4, 8)), _meta((8,)), _meta((4, 8)), _meta((4, 8)),
                             torch.float64, "interleaved", 8)),
    ("weight 2-D", lambda: (_meta((4, 8)), _meta((1, 8)), _meta((4, 8)), _meta((4, 8)), F32,
                            "interleaved", 8)),
    ("weight of another size", lambda: (_meta((4, 8)), _meta((6,)), _meta((4, 8)), _meta((4, 8)),
                                        F32, "interleaved", 8)),
    ("odd D", lambda: (_meta((4, 7)), _meta((7,)), _meta((4, 6)), _meta((4, 6)), F32,
                       "interleaved", 6)),
    ("odd n_rot", lambda: (_meta((4, 8)), _meta((8,)), _meta((4, 3)), _meta((4, 3)), F32,
                           "interleaved", 3)),
    ("n_rot over D", lambda: (_meta((4, 8)), _meta((8,)), _meta((4, 10)), _meta((4, 10)), F32,
                              "interleaved", 10)),
    ("head over MAX_D", lambda: (_meta((2, 2 * cuda_rope.MAX_D)), _meta((2 * cuda_rope.MAX_D,)),
                                 _meta((2, 2 * cuda_rope.MAX_D)), _meta((2, 2 * cuda_rope.MAX_D)),
                                 F32, "interleaved", 2 * cuda_rope.MAX_D)),
    ("last stride 2", lambda: (_meta((4, 8), stride=(16, 2)), _meta((8,)), _meta((4, 8)),
                               _meta((4, 8)), F32, "interleaved", 8)),
    ("five unmergeable leading dims", lambda: (_meta(_GAPPED[0], stride=_GAPPED[1]), _meta((4,)),
                                               _meta(_GAPPED[0]), _meta(_GAPPED[0]), F32,
                                               "interleaved", 4)),
    ("cos not broadcastable", lambda: (_meta((4, 8)), _meta((8,)), _meta((5, 8)), _meta((4, 8)),
                                       F32, "interleaved", 8)),
    ("symbolic shape", lambda: (_meta((sympy.Symbol("s0"), 8), stride=(8, 1)), _meta((8,)),
                                _meta((8,)), _meta((8,)), F32, "interleaved", 8)),
    ("unknown mode", lambda: (_meta((4, 8)), _meta((8,)), _meta((4, 8)), _meta((4, 8)), F32,
                              "neox", 8)),
    ("n_rot not an int", lambda: (_meta((4, 8)), _meta((8,)), _meta((4, 8)), _meta((4, 8)), F32,
                                  "interleaved", 8.0)),
    ("no metadata", lambda: (_meta((4, 8)), None, _meta((4, 8)), _meta((4, 8)), F32,
                             "interleaved", 8)),
    ("garbage", lambda: ("x", object(), [], {}, "f32", ["mode"], None)),
    ("unhashable mode", lambda: (_meta((4, 8)), _meta((8,)), _meta((4, 8)), _meta((4, 8)), F32,
                                 ["interleaved"], 8)),
])
def test_why_not_declines_with_a_reason_and_never_raises(why, args):
    reason = why_not(*args())
    assert isinstance(reason, str) and reason, why


def _rms_node(x: TensorMeta, w: TensorMeta | None = None, eps=1e-6, infer: bool = True,
              out: TensorMeta | None = None):
    g = Graph()
    srcs = [g.append(g.new_node("input", meta=m, is_input=True))
            for m in ([x] if w is None else [x, w])]
    if infer:
        return fxbackend.op_create(g, OP, srcs, {"eps": eps})
    out = out or _meta(x.shape, rms_norm_out_dtype(x.dtype, None if w is None else w.dtype),
                       x.device)
    return g.append(g.new_node(OP, srcs, {"eps": eps}, out))


@pytest.mark.parametrize("x, w", [(F32, None), (BF16, None), (F16, F16), (BF16, BF16),
                                  (BF16, F32), (F32, BF16)], ids=str)
def test_rms_norm_supports_cuda_metadata(x, w):
    k = RmsNormCUDA()
    wm = None if w is None else _meta((128,), w)
    assert k.supports(_rms_node(_meta((1, 4096, 24, 128), x), wm))
    assert k.supports(_rms_node(_meta(_QKV["shape"], x, stride=_QKV["stride"]), wm))
    wide = None if w is None else _meta((cuda_rms.MAX_D,), w)
    assert k.supports(_rms_node(_meta((3, cuda_rms.MAX_D), x), wide))
    assert k.supports(_rms_node(_meta((5, 1), x), None if w is None else _meta((1,), w)))


@pytest.mark.parametrize("why, node", [
    ("cpu", lambda: _rms_node(_meta((4, 8), device=_CPU), _meta((8,), device=_CPU))),
    ("weight on another device", lambda: _rms_node(_meta((4, 8)), _meta((8,), device=_CPU),
                                                   infer=False)),
    ("float64", lambda: _rms_node(_meta((4, 8), torch.float64), infer=False)),
    ("wrong out dtype", lambda: _rms_node(_meta((4, 8), BF16), _meta((8,), F32), infer=False,
                                          out=_meta((4, 8), BF16))),
    ("wrong out shape", lambda: _rms_node(_meta((4, 8)), infer=False, out=_meta((8, 4)))),
    ("weight of another size", lambda: _rms_node(_meta((4, 8)), _meta((6,)), infer=False)),
    ("row over MAX_D", lambda: _rms_node(_meta((2, 2 * cuda_rms.MAX_D)))),
    ("last stride 2", lambda: _rms_node(_meta((4, 8), stride=(16, 2)), infer=False)),
    ("five unmergeable leading dims", lambda: _rms_node(_meta(_GAPPED[0], stride=_GAPPED[1]))),
    ("symbolic shape", lambda: _rms_node(_meta((sympy.Symbol("s0"), 8), stride=(8, 1)),
                                         infer=False)),
    ("negative eps", lambda: _rms_node(_meta((4, 8)), infer=False, eps=-1.0)),
    ("eps missing", lambda: _rms_node(_meta((4, 8)), infer=False, eps=None)),
])
def test_rms_norm_supports_declines_without_raising(why, node):
    assert RmsNormCUDA().supports(node()) is False, why


def test_rms_norm_supports_never_raises_on_malformed_nodes():
    k = RmsNormCUDA()
    n = _rms_node(_meta((4, 8)), _meta((8,)))
    n.params = {}
    assert k.supports(n) is False
    n = _rms_node(_meta((4, 8)), _meta((8,)))
    n.srcs = n.srcs * 2
    assert k.supports(n) is False
    n = _rms_node(_meta((4, 8)), _meta((8,)))
    n.srcs[1].meta = None
    assert k.supports(n) is False
    n = _rms_node(_meta((4, 8)))
    n.meta = None
    assert k.supports(n) is False


# -- launch layout (pure Python) ----------------------------------------------------------------

def test_the_fused_plan_is_the_rope_layout_and_is_cached():
    x = torch.empty(2, 7, 3, 128).transpose(1, 2)
    cos, w = torch.empty(7, 64), torch.empty(256)[::2]
    p = fused._plan_of_tensors(x, w, cos, cos, "split_half", 64)
    assert p.rope == cuda_rope._plan_of_tensors(x, cos, cos, "split_half", 64)
    assert p.w_stride == 2 and p.num_warps == cuda_rope.NUM_WARPS
    assert fused._plan_of_tensors(x, w, cos, cos, "split_half", 64) is p, "not cached"


def test_rms_norm_plan_layout():
    p = cuda_rms._plan_of_tensors(torch.empty(1, 4096, 24, 128), torch.empty(128))
    assert (p.block_d, p.block_r, p.num_warps) == (128, 16, 4)
    assert p.grid == (4096 * 24 // 16,) and p.args[:2] == (4096 * 24, 128)
    qkv = torch.empty(2, 5, 3 * 4 * 8).view(2, 5, 3, 4, 8)[:, :, 1].transpose(1, 2)
    p = cuda_rms._plan_of_tensors(qkv, None)
    # [B,H,S] with strides (S*3*H*D, D, 3*H*D): nothing merges
    assert p.args[2:5] == (2, 4, 5)
    assert p.args[5:9] == (0, 5 * 3 * 4 * 8, 8, 3 * 4 * 8) and p.has_weight is False
    p = cuda_rms._plan_of_tensors(torch.empty(3, cuda_rms.MAX_D), None)
    assert (p.block_r, p.block_d, p.num_warps) == (1, cuda_rms.MAX_D, 16)
    assert cuda_rms._plan_of_tensors(torch.empty(0, 8), None).grid == (0,)
    assert cuda_rms._plan_of_tensors(torch.empty(5, 0), None).grid == (0,)


def test_rms_norm_prepare_plans_from_metadata_and_execute_replans_for_other_strides():
    x = torch.empty(2, 7, 3, 8).transpose(1, 2)
    w = torch.empty(8)
    n = _rms_node(TensorMeta.of(x), TensorMeta.of(w))
    state, ws = RmsNormCUDA().prepare(n)
    assert ws == 0 and len(state.launches) == 1
    assert state.get(x, w) is next(iter(state.launches.values()))
    assert len(state.launches) == 1, "the tensors match the metadata: no re-plan"
    assert state.get(x.contiguous(), w) == cuda_rms._plan_of_tensors(x.contiguous(), w)
    assert len(state.launches) == 2


def _z(*shape, dtype=F32):
    return torch.zeros(*shape, dtype=dtype)


@pytest.mark.parametrize("why, args, kw", [
    ("float64 x", lambda: (_z(4, 8, dtype=torch.float64), _z(8), _z(4, 8), _z(4, 8), _z(4, 8)), {}),
    ("float64 out", lambda: (_z(4, 8), _z(8), _z(4, 8), _z(4, 8),
                             _z(4, 8, dtype=torch.float64)), {}),
    ("out not contiguous", lambda: (_z(4, 8), _z(8), _z(4, 8), _z(4, 8), _z(8, 4).t()), {}),
    ("out of another shape", lambda: (_z(4, 8), _z(8), _z(4, 8), _z(4, 8), _z(32)), {}),
    ("weight of another size", lambda: (_z(4, 8), _z(6), _z(4, 8), _z(4, 8), _z(4, 8)), {}),
    ("no weight", lambda: (_z(4, 8), None, _z(4, 8), _z(4, 8), _z(4, 8)), {}),
    ("last stride 2", lambda: (_z(4, 16)[:, ::2], _z(8), _z(4, 8), _z(4, 8), _z(4, 8)), {}),
    ("odd D", lambda: (_z(4, 7), _z(7), _z(4, 6), _z(4, 6), _z(4, 7)), {"n_rot": 6}),
    ("mode", lambda: (_z(4, 8), _z(8), _z(4, 8), _z(4, 8), _z(4, 8)), {"mode": "neox"}),
    ("negative eps", lambda: (_z(4, 8), _z(8), _z(4, 8), _z(4, 8), _z(4, 8)), {"eps": -1.0}),
    ("scale a tensor", lambda: (_z(4, 8), _z(8), _z(4, 8), _z(4, 8), _z(4, 8)),
     {"scale": torch.tensor(2.0)}),
    ("cos not broadcastable", lambda: (_z(4, 8), _z(8), _z(5, 8), _z(4, 8), _z(4, 8)), {}),
])
def test_the_fused_launcher_rejects_what_the_kernel_does_not_take(why, args, kw):
    kw = {"eps": 1e-6, "mode": "interleaved", "n_rot": 8, **kw}
    with pytest.raises(ValueError, match="rms_rope_triton"):
        rms_rope_triton(*args(), **kw)


@pytest.mark.parametrize("why, args", [
    ("float64", lambda: (_z(4, 8, dtype=torch.float64), None, 1e-6, None)),
    ("wrong out dtype", lambda: (_z(4, 8, dtype=BF16), _z(8), 1e-6, _z(4, 8, dtype=BF16))),
    ("out not contiguous", lambda: (_z(4, 8), None, 1e-6, _z(8, 4).t())),
    ("weight of another size", lambda: (_z(4, 8), _z(6), 1e-6, None)),
    ("last stride 2", lambda: (_z(4, 16)[:, ::2], None, 1e-6, None)),
    ("row over MAX_D", lambda: (_z(2, 2 * cuda_rms.MAX_D), None, 1e-6, None)),
    ("negative eps", lambda: (_z(4, 8), None, -1.0, None)),
])
def test_the_rms_norm_launcher_rejects_what_the_kernel_does_not_take(why, args):
    with pytest.raises(ValueError, match="rms_norm_triton"):
        rms_norm_triton(*args())


def test_compile_is_a_no_op_off_cuda():
    n = _rms_node(_meta((4, 8), device=_CPU), _meta((8,), device=_CPU))
    assert RmsNormCUDA().compile(n) is None
    m = _meta((4, 8), device=_CPU)
    assert fused.compile_kernels(m, _meta((8,), device=_CPU), m, m, F32, "interleaved", 8) is None


# -- compiled mode without a GPU: Triton's ahead-of-time path down to an sm_90 cubin ------------

_COMPILED_ONLY = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") == "1",
                                    reason="compiled mode only")


@_COMPILED_ONLY
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("dtypes, scale", [
    ((BF16, BF16, F32, F32, BF16), None), ((BF16, BF16, BF16, BF16, F32), SCALE),
    ((F32,) * 5, SCALE), ((F16, F16, F16, F16, BF16), None), ((BF16, F32, F32, F32, BF16), None),
], ids=["bf16", "bf16-scale-f32out", "fp32-scale", "fp16-bf16out", "bf16x-f32w"])
def test_the_fused_kernel_compiles_for_sm90_without_a_gpu(mode, dtypes, scale):
    """Catches what the interpreter does not check (types, constexpr handling, lowering)."""
    x = torch.empty(2, 7, 3, 128).transpose(1, 2)  # strided rows: three leading dims
    t = torch.empty(7, 64)
    p = fused._plan_of_tensors(x, torch.empty(128), t, t, mode, 64)
    r = p.rope
    ck = interp.aot_compile(fused._kernel(), dtypes, (*r.args, p.w_stride, 1e-6, scale or 1.0),
                            {"INTERLEAVED": r.interleaved, "HAS_SCALE": scale is not None,
                             "BLOCK_R": r.block_r, "BLOCK_D": r.block_d},
                            {"num_warps": p.num_warps, "enable_fp_fusion": False})
    assert ck.asm.get("cubin"), "no cubin"


@_COMPILED_ONLY
@pytest.mark.parametrize("shape, dtypes", [
    ((1, 4096, 24, 128), (BF16, BF16, BF16)), ((4, 1), (F32, None, F32)),
    ((2, 1024, 5120), (BF16, F32, F32)), ((3, cuda_rms.MAX_D), (F16, None, F16)),
], ids=["qk_bf16", "d1_noweight", "wan_hidden_f32w", "max_d"])
def test_the_rms_norm_kernel_compiles_for_sm90_without_a_gpu(shape, dtypes):
    x_dt, w_dt, out_dt = dtypes
    x = torch.empty(shape)
    p = cuda_rms._plan_of_tensors(x, None if w_dt is None else torch.empty(shape[-1]))
    ck = interp.aot_compile(cuda_rms._kernel(), (x_dt, w_dt or x_dt, out_dt), (*p.args, 1e-6),
                            {"HAS_WEIGHT": p.has_weight, "BLOCK_R": p.block_r,
                             "BLOCK_D": p.block_d},
                            {"num_warps": p.num_warps, "enable_fp_fusion": False})
    assert ck.asm.get("cubin"), "no cubin"


# -- on a GPU: real sizes -----------------------------------------------------------------------

# (name, layout, (B, S, H, D), n_rot, mode, cos/sin shape, scale)
CUDA_CONFIGS = [
    ("flux_bshd", "bshd", (1, 4096, 24, 128), 128, "interleaved", (4096, 1, 128), None),
    ("flux_bhsd_view", "bhsd_view", (1, 4096, 24, 128), 128, "interleaved", (4096, 128), SCALE),
    ("qkv_partial", "qkv_bhsd", (2, 1024, 16, 128), 64, "split_half", (1, 1, 1024, 64), SCALE),
]
# (x dtype, weight dtype, out dtype or None for Tn)
CUDA_DTYPES = [(BF16, BF16, None), (F32, F32, None), (BF16, F32, BF16), (F16, F16, F32)]


def _cuda_x(layout: str, bshd: tuple, dtype, g) -> torch.Tensor:
    b, s, h, d = bshd
    if layout == "bshd":
        return torch.randn(b, s, h, d, device="cuda", dtype=dtype, generator=g)
    if layout == "bhsd_view":  # [B,S,H,D] permuted to [B,H,S,D]
        return torch.randn(b, s, h, d, device="cuda", dtype=dtype, generator=g).transpose(1, 2)
    qkv = torch.randn(b, s, 3 * h * d, device="cuda", dtype=dtype, generator=g)
    return qkv.view(b, s, 3, h, d)[:, :, 1].transpose(1, 2)


def _cuda_inputs(cfg, x_dt, w_dt):
    name, layout, bshd, n_rot, mode, table, scale = cfg
    g = torch.Generator(device="cuda").manual_seed(0)
    x = _cuda_x(layout, bshd, x_dt, g)
    w = (torch.rand(bshd[-1], device="cuda", generator=g) + 0.5).to(w_dt)
    ang = torch.rand(*table, device="cuda", generator=g) * 6.28  # float32 tables, as in Flux
    return x, w, ang.cos(), ang.sin(), mode, n_rot, scale


def _check(out, want):
    dts = [out.dtype, want.dtype]
    tol = _tol(*dts)
    torch.testing.assert_close(out, want, atol=tol["atol"], rtol=tol["rtol"])
    exact = (out == want).float().mean().item()
    assert exact >= tol["min_exact"], f"only {exact:.4f} bit-equal"
    return (out.float() - want.float()).abs().max().item(), exact


@pytest.mark.cuda
@pytest.mark.parametrize("x_dt, w_dt, out_dt", CUDA_DTYPES, ids=lambda d: _name(d) or "tn")
@pytest.mark.parametrize("cfg", CUDA_CONFIGS, ids=[c[0] for c in CUDA_CONFIGS])
def test_cuda_fused_matches_the_reference(cfg, x_dt, w_dt, out_dt):
    x, w, cos, sin, mode, n_rot, scale = _cuda_inputs(cfg, x_dt, w_dt)
    out_dt = out_dt or w_dt
    assert why_not(TensorMeta.of(x), TensorMeta.of(w), TensorMeta.of(cos), TensorMeta.of(sin),
                   out_dt, mode, n_rot) is None
    out = torch.empty(x.shape, dtype=out_dt, device="cuda")
    rms_rope_triton(x, w, cos, sin, out, eps=1e-6, mode=mode, n_rot=n_rot, scale=scale)
    want = rms_rope_reference(x, w, cos, sin, 1e-6, mode, n_rot, scale, out_dt)
    # the reference's tolerance is the coarser of Tn and out's dtype
    tol = _tol(w_dt, out_dt)
    torch.testing.assert_close(out, want, atol=tol["atol"], rtol=tol["rtol"])
    exact = (out == want).float().mean().item()
    assert exact >= tol["min_exact"], f"only {exact:.4f} bit-equal"
    print(f"\n[rms_rope cuda] {cfg[0]} {_name(x_dt)}/{_name(w_dt)}->{_name(out_dt)}: max err "
          f"{(out.float() - want.float()).abs().max().item():.3g}, bit-equal {exact:.4f}")


@pytest.mark.cuda
def test_cuda_compile_kernels_warms_then_runs_on_the_current_stream():
    x, w, cos, sin, mode, n_rot, scale = _cuda_inputs(CUDA_CONFIGS[2], BF16, BF16)
    metas = [TensorMeta.of(t) for t in (x, w, cos, sin)]
    fused.compile_kernels(*metas, BF16, mode, n_rot, scale)
    out = torch.empty(x.shape, dtype=BF16, device="cuda")
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        rms_rope_triton(x, w, cos, sin, out, eps=1e-6, mode=mode, n_rot=n_rot, scale=scale)
    side.synchronize()
    _check(out, rms_rope_reference(x, w, cos, sin, 1e-6, mode, n_rot, scale, BF16))


# (name, shape, x dtype, weight dtype or None, strided rows)
CUDA_RMS = [
    ("qk_bf16", (1, 4096, 24, 128), BF16, BF16, False),
    ("qk_f32_qkv", (2, 1024, 16, 128), F32, F32, True),
    ("wan_hidden_f32w", (1, 4096, 5120), BF16, F32, False),
    ("noweight_f16", (3, 333, 64), F16, None, False),
]


@pytest.mark.cuda
@pytest.mark.usefixtures("registry_guard")
@pytest.mark.parametrize("name, shape, x_dt, w_dt, strided", CUDA_RMS, ids=[c[0] for c in CUDA_RMS])
def test_cuda_rms_norm_graph_matches_the_reference(name, shape, x_dt, w_dt, strided):
    g = torch.Generator(device="cuda").manual_seed(0)
    if strided:
        x = _cuda_x("qkv_bhsd", shape, x_dt, g)
    else:
        x = torch.randn(*shape, device="cuda", dtype=x_dt, generator=g)
    w = None if w_dt is None else (torch.rand(shape[-1], device="cuda", generator=g) + 0.5).to(w_dt)
    inputs = [x] if w is None else [x, w]
    gr = Graph()
    srcs = [gr.append(gr.new_node("input", meta=TensorMeta.of(t), is_input=True)) for t in inputs]
    set_outputs(gr, fxbackend.op_create(gr, OP, srcs, {"eps": 1e-6}))
    cg = compiled(gr)
    (out,) = cg(*inputs)
    err, exact = _check(out, rms_norm_reference(x, w, 1e-6))
    assert fxbackend.stats()["steps_by_kernel"].get("rms_norm_triton") == 1
    print(f"\n[rms_norm cuda] {name}: max err {err:.3g}, bit-equal {exact:.4f}")


@pytest.mark.cuda
@pytest.mark.usefixtures("registry_guard")
def test_cuda_rms_norm_compile_warms_the_kernel_then_runs():
    x = torch.randn(2, 1024, 16, 128, device="cuda", dtype=F16)
    w = torch.rand(128, device="cuda").to(F16)
    n = _rms_node(TensorMeta.of(x), TensorMeta.of(w))
    k = RmsNormCUDA()
    assert k.supports(n)
    k.compile(n)
    state, _ = k.prepare(n)
    out = torch.empty(x.shape, dtype=F16, device="cuda")
    k.execute(fxbackend.ExecContext(x.device), n, state, [x, w], out, None)
    _check(out, rms_norm_reference(x, w, 1e-6))


def _bench_module():
    path = HERE.parent / "scripts" / "bench_rms_rope_cuda.py"
    spec = importlib.util.spec_from_file_location("bench_rms_rope_cuda", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_the_bandwidth_script_exits_cleanly_without_a_gpu(tmp_path):
    if torch.cuda.is_available():
        pytest.skip("has a GPU")
    out = tmp_path / "bw.txt"
    proc = subprocess.run([sys.executable, str(HERE.parent / "scripts" / "bench_rms_rope_cuda.py"),
                           "--out", str(out)], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert "no CUDA GPU" in proc.stdout + proc.stderr and not out.exists()


@pytest.mark.cuda
def test_cuda_bandwidth():
    """Achieved GB/s of the fused kernel next to torch's copy of the same bytes (printed; the
    benchmark script writes the full table)."""
    res = _bench_module().measure_bandwidth(iters=20)
    print("\n" + res["text"])
    assert res["fused_gbs"] > 0 and res["copy_gbs"] > 0
