"""The ``rms_rope`` fusion rule (patterns/rope.py): RMSNorm -> Mul(weight) -> RoPE [-> Scale]
[-> cast / copy to fp16/bf16] as one step, on written-out diffusers code and on Flux.

The rule logic is tested here with the torch implementation of the kernel interface
(``ReferenceRmsRope``) registered under a test name; the device kernels have their own tests
(tests/test_rms_rope_cpu.py, tests/test_rms_rope_cuda.py)."""
from __future__ import annotations

import re

import pytest
import torch
from diffusers.models.embeddings import apply_rotary_emb
from diffusers.models.normalization import RMSNorm

import fxbackend
from fxbackend.patterns.rope import ReferenceRmsRope, RmsRopeFusion, rms_rope_reference

from ext_util import eager_and_compiled, rel_err, rule_on_top

#: tiny Flux's other rewrites: identity_arith drops its multiplications/divisions by 1 (timestep
#: scale, RoPE frequencies); attention_kv_contiguous lays out k and v of its 2 attention steps
_FLUX_OTHER = {"identity_arith": 8, "attention_kv_contiguous": 2}


class _Impl(ReferenceRmsRope):
    def __init__(self, decline: str | None = None) -> None:
        self.decline = decline
        self.calls = 0

    def why_not(self, *a):
        return self.decline

    def run(self, *a, **kw):
        self.calls += 1
        super().run(*a, **kw)


@pytest.fixture
def rule():
    """The rule registered for "cpu" with the torch implementation, above any device rule."""
    with rule_on_top(RmsRopeFusion(_Impl()), "rms_rope_test") as r:
        yield r


def _attention_inputs(dtype=torch.float32, s=6, h=2, d=8, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(1, s, h * d, generator=g).to(dtype)
    k = torch.randn(1, s, h * d, generator=g).to(dtype)
    cos = torch.randn(s, d, generator=g)
    sin = torch.randn(s, d, generator=g)
    return q, k, cos, sin


class _QK(torch.nn.Module):
    """Flux's order: norm_q(q); norm_k(k); rope(q); rope(k) (the chains interleave)."""

    def __init__(self, d=8, h=2, dtype=torch.float32, scale=None, out_dtype=None):
        super().__init__()
        g = torch.Generator().manual_seed(3)
        self.h, self.scale, self.out_dtype = h, scale, out_dtype
        self.norm_q, self.norm_k = RMSNorm(d, eps=1e-6), RMSNorm(d, eps=1e-6)
        for n in (self.norm_q, self.norm_k):
            n.weight.data = (torch.rand(d, generator=g) + 0.5).to(dtype)

    def forward(self, q, k, cos, sin):
        q = self.norm_q(q.unflatten(-1, (self.h, -1)))
        k = self.norm_k(k.unflatten(-1, (self.h, -1)))
        q = apply_rotary_emb(q, (cos, sin), sequence_dim=1)
        k = apply_rotary_emb(k, (cos, sin), sequence_dim=1)
        if self.scale is not None:
            q, k = q * self.scale, k * self.scale
        if self.out_dtype is not None:
            q, k = q.to(self.out_dtype), k.to(self.out_dtype)
        return q.transpose(1, 2), k.transpose(1, 2)


def _run(mod, *args, options=None):
    with torch.no_grad():
        return torch.compile(mod, backend="fxbackend", options=options)(*args), mod(*args)


def test_interleaved_q_and_k_chains_both_fuse(rule):
    args = _attention_inputs()
    (q, k), (rq, rk) = _run(_QK(), *args)
    torch.testing.assert_close(q, rq, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(k, rk, rtol=1e-5, atol=1e-5)
    s = fxbackend.stats()
    assert s["rewrites_by_rule"] == {"rms_norm": 2, "rope": 2}
    assert s["fusions_by_rule"] == {"rms_rope_test": 2}
    assert rule.impl.calls == 2


def test_fused_equals_unfused(rule):
    args = _attention_inputs(s=9)
    mod = _QK()
    with torch.no_grad():
        fused = torch.compile(mod, backend="fxbackend")(*args)
        torch._dynamo.reset()
        unfused = torch.compile(mod, backend="fxbackend", options={"fusion": False})(*args)
    for a, b in zip(fused, unfused):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("dtype,out_dtype", [(torch.float32, torch.bfloat16),
                                             (torch.bfloat16, None),
                                             (torch.float32, torch.float16)])
def test_scale_and_cast_join_the_fused_step(rule, dtype, out_dtype):
    args = _attention_inputs(dtype)
    mod = _QK(dtype=dtype, scale=0.125, out_dtype=out_dtype)
    text = fxbackend.explain(mod, *args)
    fused = [ln for ln in text.splitlines() if "fused.rms_rope_test" in ln]
    assert len(fused) == 2, text
    want = out_dtype or dtype
    assert all({torch.bfloat16: "bf16[", torch.float16: "f16["}.get(want, "f32[") in ln
               for ln in fused)
    (q, k), (rq, rk) = _run(mod, *args)
    tol = dict(rtol=1e-5, atol=1e-5) if want == torch.float32 else dict(rtol=1e-2, atol=1e-2)
    torch.testing.assert_close(q, rq, **tol)
    torch.testing.assert_close(k, rk, **tol)


def test_copy_back_into_the_normalised_input_joins_the_step(rule):
    # x.copy_(rope(norm(x)) * s), functionalised: copy(x, r) then copy_(x, _) at the end
    w = torch.rand(8) + 0.5

    def f(x, w, cos, sin):
        var = x.float().pow(2).mean(-1, keepdim=True)
        n = (x * torch.rsqrt(var + 1e-6)).to(torch.bfloat16) * w
        r = apply_rotary_emb(n, (cos, sin), sequence_dim=1) * 0.5
        x.copy_(r)
        return x.sum()

    g = torch.Generator().manual_seed(5)
    x = torch.randn(1, 6, 2, 8, generator=g).to(torch.bfloat16)
    cos, sin = torch.randn(6, 8, generator=g), torch.randn(6, 8, generator=g)
    wb = w.to(torch.bfloat16)
    want = x.clone()
    f(want, wb, cos, sin)
    got = x.clone()
    with torch.no_grad():
        torch.compile(f, backend="fxbackend")(got, wb, cos, sin)
    torch.testing.assert_close(got, want, rtol=1e-2, atol=1e-2)
    assert fxbackend.stats()["fusions_by_rule"] == {"rms_rope_test": 1}
    # norm, rope, scale and the functionalised copy (a cast into x's dtype): one step
    text = fxbackend.explain(f, x.clone(), wb, cos, sin)
    assert "aten.copy.default" not in text and "aten.mul.Tensor" not in text, text


def test_rule_declines_when_the_kernel_does():
    with rule_on_top(RmsRopeFusion(_Impl(decline="no kernel for this")),
                     "rms_rope_declining") as r:
        args = _attention_inputs()
        (q, _), (rq, _) = _run(_QK(), *args)
        assert "rms_rope_declining" not in fxbackend.stats()["fusions_by_rule"]
        text = fxbackend.explain(_QK(), *args)
    torch.testing.assert_close(q, rq, rtol=1e-5, atol=1e-5)
    assert r.impl.calls == 0
    assert "declined rms_rope_declining on" in text and "no kernel for this" in text


def test_reference_is_the_unfused_chain():
    from fxbackend.patterns.rmsnorm import rms_norm_reference
    from fxbackend.patterns.rope import rope_reference
    q, _, cos, sin = _attention_inputs(torch.bfloat16)
    x = q.unflatten(-1, (2, -1))
    w = torch.rand(8).to(torch.bfloat16)
    want = (rope_reference(rms_norm_reference(x, w, 1e-6), cos[:, None], sin[:, None],
                           "interleaved", 8) * 0.5).to(torch.float16)
    got = rms_rope_reference(x, w, cos[:, None], sin[:, None], 1e-6, "interleaved", 8, 0.5,
                             torch.float16)
    assert torch.equal(got, want)


def test_terminal_copy_into_an_input_it_reads_goes_through_workspace(rule):
    # a hand-built graph: copy_(x, rope(norm(x, w)) * 0.5) writes the storage the step reads
    from test_fusion import GraphBuilder
    aten = torch.ops.aten
    b = GraphBuilder()
    x = b.input(1, 6, 2, 8, dtype=torch.bfloat16)
    w = b.input(8, dtype=torch.bfloat16)
    cos, sin = b.input(6, 8), b.input(6, 8)
    cu, su = b.op(aten.unsqueeze.default, cos, 1), b.op(aten.unsqueeze.default, sin, 1)
    norm = fxbackend.op_create(b.g, "sd.rms_norm.v1", [x, w], {"eps": 1e-6})
    rope = fxbackend.op_create(b.g, "sd.rope_apply.v1", [norm, cu, su],
                               {"mode": "interleaved", "n_rot": 8})
    scaled = b.op(aten.mul.Tensor, rope, 0.5)
    write = b.op(aten.copy_.default, x, scaled)
    assert write.inplace_of is x
    g = b.output(write)
    gen = torch.Generator().manual_seed(7)
    args = [torch.randn(1, 6, 2, 8, generator=gen).to(torch.bfloat16),
            (torch.rand(8, generator=gen) + 0.5).to(torch.bfloat16),
            torch.randn(6, 8, generator=gen), torch.randn(6, 8, generator=gen)]
    want = rms_rope_reference(args[0], args[1], args[2][:, None], args[3][:, None], 1e-6,
                              "interleaved", 8, 0.5, torch.bfloat16)
    plan = fxbackend.CompiledGraph(g, fxbackend.Options()).plan_for(args)
    assert [n.op for n in plan.graph.nodes if not n.is_input and n.view_of is None] == \
        ["fused.rms_rope_test"]
    assert plan.workspace_bytes >= want.numel() * 2
    (out,) = plan(*args)
    assert torch.equal(args[0], want)  # the input holds the result...
    assert out.data_ptr() == args[0].data_ptr()  # ...and the output is that input


def test_flux_fuses_q_and_k_of_every_single_stream_block():
    # the shipped CPU rule (numba kernel), no test rule registered.  Every RoPE of Flux becomes
    # sd.rope_apply.v1 (rewrites) and every QK RMSNorm sd.rms_norm.v1
    ref, out, model = eager_and_compiled("flux")
    assert rel_err(out, ref) <= 1e-5
    s = fxbackend.stats()
    assert s["rewrites_by_rule"] == {"rope": 4, "rms_norm": 6, **_FLUX_OTHER}
    n_single = model.config.num_single_layers
    # the double-stream block concatenates text and image q/k between norm and RoPE: no chain
    assert s["fusions_by_rule"]["rms_rope"] == 2 * n_single
    assert s["steps_by_kernel"]["rms_rope"] == 2 * n_single
    assert s["steps_by_kernel"]["rope_apply_cpu"] == 2  # the double-stream block's q and k
    assert s["steps_by_kernel"]["rms_norm_cpu"] == 4  # its four QK norms


def test_golden_fused_step():
    # the plan of _QK: each norm moved down to its RoPE by optimize, then norm + RoPE claimed as
    # one fused.rms_rope step (regenerate with EXPECTTEST_ACCEPT=1 and review the diff)
    from expecttest import assert_expected_inline

    mod = _QK()
    text = fxbackend.explain(mod, *_attention_inputs())
    first_plan = re.split(r"(?m)^plan graph\d+", text)[1]  # graph numbers count per process
    # the host's CPU and the passes' times vary: not part of the golden text
    first_plan = "".join(ln for ln in first_plan.splitlines(keepends=True)
                         if not ln.startswith(("cpu profile", "cpu decision", "plan-time")))
    first_plan = first_plan.rstrip("\n") + "\n"
    assert_expected_inline(first_plan, """\
: arena 0.00 MB (sum of intermediates 0.00 MB), workspace 0.00 MB (0 bytes)
%0 = input : f32[1,6,16]
%1 = weight : f32[8]
%2 = input : f32[1,6,16]
%3 = weight : f32[8]
%4 = input : f32[6,8]
%5 = input : f32[6,8]
%6 = aten.view.default(%0) {size=[1, 6, 2, 8]} : f32[1,6,2,8]  # view_of=%0  [native]
%13 = aten.view.default(%2) {size=[1, 6, 2, 8]} : f32[1,6,2,8]  # view_of=%2  [native]
%20 = aten.unsqueeze.default(%4) {dim=0} : f32[1,6,8]  # view_of=%4  [native]
%21 = aten.unsqueeze.default(%20) {dim=2} : f32[1,6,1,8]  # view_of=%20  [native]
%22 = aten.unsqueeze.default(%5) {dim=0} : f32[1,6,8]  # view_of=%5  [native]
%23 = aten.unsqueeze.default(%22) {dim=2} : f32[1,6,1,8]  # view_of=%22  [native]
%54 = fused.rms_rope(%6, %1, %21, %23) : f32[1,6,2,8]  [rms_rope]
%34 = aten.unsqueeze.default(%4) {dim=0} : f32[1,6,8]  # view_of=%4  [native]
%35 = aten.unsqueeze.default(%34) {dim=2} : f32[1,6,1,8]  # view_of=%34  [native]
%36 = aten.unsqueeze.default(%5) {dim=0} : f32[1,6,8]  # view_of=%5  [native]
%37 = aten.unsqueeze.default(%36) {dim=2} : f32[1,6,1,8]  # view_of=%36  [native]
%55 = fused.rms_rope(%13, %3, %35, %37) : f32[1,6,2,8]  [rms_rope]
%48 = aten.transpose.int(%54) {dim0=1, dim1=2} : f32[1,2,6,8]{96,8,16,1}  # view_of=%54 output  [native]
%49 = aten.transpose.int(%55) {dim0=1, dim1=2} : f32[1,2,6,8]{96,8,16,1}  # view_of=%55 output  [native]
fused rms_rope: %50, %52
fused rms_rope: %51, %53
""")


# -- torch.nn.RMSNorm on 16-bit inputs: the weight multiplied in float32 (weight_in_float) -------

@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_torch_rmsnorm_16bit_becomes_the_op_and_stays_exact(dtype):
    norm = torch.nn.RMSNorm(16, eps=1e-6).to(dtype)
    norm.weight.data = (torch.rand(16, generator=torch.Generator().manual_seed(2)) + 0.5).to(dtype)
    x = torch.randn(3, 5, 16).to(dtype)
    with torch.no_grad():
        out = torch.compile(lambda t: norm(t) * 2, backend="fxbackend")(x)
        ref = norm(x) * 2
    assert torch.equal(out, ref)  # (x.float() * r * w.float()).to(x.dtype), rounded once
    s = fxbackend.stats()
    assert s["rewrites_by_rule"] == {"rms_norm": 1}
    assert s["steps_by_kernel"]["rms_norm_cpu"] == 1


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_fused_kernel_weight_in_float_matches_the_reference(dtype):
    from fxbackend.cpu_kernels.rms_rope import RmsRopeCPU
    g = torch.Generator().manual_seed(0)
    x = torch.randn(1, 13, 3, 18, generator=g).to(dtype)
    w = (torch.rand(18, generator=g) + 0.5).to(dtype)
    cos, sin = torch.randn(13, 1, 18, generator=g), torch.randn(13, 1, 18, generator=g)
    other = torch.float16 if dtype == torch.bfloat16 else torch.bfloat16
    kernel = RmsRopeCPU()
    for mode in ("interleaved", "split_half"):
        for scale, out_dtype in ((None, dtype), (0.5, other)):
            out = torch.empty(x.shape, dtype=out_dtype)
            kernel.compile(x, w, cos, sin, out_dtype, mode, 18, scale, weight_in_float=True)
            kernel.run(x, w, cos, sin, out, eps=1e-6, mode=mode, n_rot=18, scale=scale,
                       weight_in_float=True)
            want = rms_rope_reference(x, w, cos, sin, 1e-6, mode, 18, scale, out_dtype, True)
            # every rounding of the chain in place; the sum of squares in the kernel's order
            # may move one element by one unit in the last place
            assert (out == want).float().mean().item() >= 0.99
            torch.testing.assert_close(out, want, rtol=1.6e-2, atol=1.6e-2)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_16bit_flux_fuses_q_and_k_with_torch_rmsnorm(dtype):
    ref, out, model = eager_and_compiled("flux", dtype=dtype)
    assert torch.equal(out, ref)
    s = fxbackend.stats()
    assert s["rewrites_by_rule"] == {"rope": 4, "rms_norm": 6, **_FLUX_OTHER}
    assert s["fusions_by_rule"]["rms_rope"] == 2 * model.config.num_single_layers
