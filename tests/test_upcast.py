"""``compute_in_float32`` (``patterns/upcast.py``): 16-bit GEMMs and convolutions in float32
where the CPU profile says the CPU has no 16-bit dot products, nothing changed where it has
them.  The profile is set per test (``FXB_CPU_PROFILE``)."""
from __future__ import annotations

import pytest
import torch

import fxbackend

#: the bfloat16 decision of the classes tested (tests/test_cpu_profile.py checks every class)
BF16 = {"avx2": "float32", "amx": "native"}

pytestmark = pytest.mark.cpu_profile


class _ConvNet(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.c1 = torch.nn.Conv2d(4, 16, 3, padding=1)
        self.c2 = torch.nn.Conv2d(16, 16, 3, padding=1)
        self.lin = torch.nn.Linear(16, 8)

    def forward(self, x):
        h = torch.nn.functional.silu(self.c1(x))
        h = self.c2(h) + h
        return self.lin(h.mean((2, 3)))


def _rel(a, ref):
    return ((a.float() - ref).abs().max() / ref.abs().max()).item()


@pytest.mark.parametrize("name", ["avx2", "amx"])
def test_bf16_gemms_and_convolutions_follow_the_16bit_decision(name, monkeypatch):
    monkeypatch.setenv("FXB_CPU_PROFILE", name)
    torch.manual_seed(0)
    m32 = _ConvNet().eval()
    m16 = _ConvNet().eval()
    m16.load_state_dict(m32.state_dict())
    m16 = m16.to(torch.bfloat16)
    x = torch.randn(2, 4, 16, 16)
    with torch.no_grad():
        ref = m32(x)
        eager = m16(x.bfloat16())
    torch._dynamo.reset()
    fxbackend.reset_stats()
    compiled = torch.compile(m16, backend="fxbackend")
    with torch.no_grad():
        got = compiled(x.bfloat16())
        again = compiled(x.bfloat16())
    assert got.dtype == torch.bfloat16 and torch.equal(got, again)
    rewritten = fxbackend.stats()["rewrites_by_rule"].get("compute_in_float32", 0)
    if BF16[name] == "float32":
        assert rewritten == 3  # two convolutions and the linear
        # the upcast weights are computed once and kept between calls
        assert fxbackend.stats()["weight_steps_cached"] >= 3
        # one rounding of a float32 result: no worse than bf16 eager (plus half an ulp)
        assert _rel(got, ref) <= _rel(eager, ref) + 2 ** -8
    else:
        assert rewritten == 0
        torch.testing.assert_close(got, eager, rtol=2e-2, atol=2e-2)


def test_the_16bit_rewrite_can_be_turned_off(monkeypatch):
    monkeypatch.setenv("FXB_CPU_PROFILE", "avx2")
    model = _ConvNet().eval().to(torch.bfloat16)
    x = torch.randn(1, 4, 8, 8).bfloat16()
    report = fxbackend.explain(model, x, options={"disable_rewrites": ["compute_in_float32"]})
    assert "cpu decision bfloat16: float32" in report  # decided, and not applied
    torch._dynamo.reset()
    fxbackend.reset_stats()
    with torch.no_grad():
        torch.compile(model, backend="fxbackend",
                      options={"disable_rewrites": ["compute_in_float32"]})(x)
    assert "compute_in_float32" not in fxbackend.stats()["rewrites_by_rule"]



@pytest.mark.parametrize("family", ["unet", "flux"])
def test_bf16_models_on_a_cpu_without_bf16_dot_products(family, monkeypatch):
    """A whole bf16 model under ``FXB_CPU_PROFILE=avx2``: its GEMMs and convolutions compute
    in float32 (every fusion around them still applies), and it is no further from the
    float32 model than bf16 eager is (plus one bf16 rounding of the output)."""
    import fxbackend.models as models
    monkeypatch.setenv("FXB_CPU_PROFILE", "avx2")
    m32 = models.build_model(family, "tiny", torch.float32)
    m16 = models.build_model(family, "tiny", torch.bfloat16)
    with torch.no_grad():
        ref = models.run_eager(m32, models.make_inputs(family, "tiny", dtype=torch.float32))
        inp = models.make_inputs(family, "tiny", dtype=torch.bfloat16)
        eager = models.run_eager(m16, inp)
        torch._dynamo.reset()
        fxbackend.reset_stats()
        got = models.run_eager(torch.compile(m16, backend="fxbackend"), inp)
    ref = ref.float()
    assert fxbackend.stats()["rewrites_by_rule"].get("compute_in_float32", 0) > 0
    # the activations after a linear still fuse, across the rounding of the float32 GEMM (the
    # tiny configs' linear_act chains, tests/test_activation.py's MODEL_FIRES); GEGLU's gated
    # chains have no rounding kernel and stay unfused
    fires = fxbackend.stats()["fusions_by_rule"]
    assert fires.get("linear_act") == {"flux": 6, "unet": 1}[family]
    assert "linear_glu" not in fires
    assert _rel(got, ref) <= _rel(eager, ref) + 2 ** -8, (_rel(got, ref), _rel(eager, ref))
