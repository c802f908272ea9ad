"""float32 linears through oneDNN (``cpu_kernels/gemm.py``) where the CPU profile's
``float32_gemm`` decision says so: the decision from the probe, the kernels against torch's
``addmm``, whole models against eager, and weights changed after compiling."""
from __future__ import annotations

import pytest
import torch

import fxbackend
import fxbackend.models
from fxbackend import cpu
from fxbackend.cpu_kernels import gemm

pytestmark = pytest.mark.cpu_profile

needs_onednn = pytest.mark.skipif(not cpu.onednn_float32_linear_available(),
                                  reason="this torch has no oneDNN float32 linear")

#: every probe figure (the float32_gemm one set by each test)
_PROBES = {"int_mm_speedup": 3.0, "quantized_linear_speedup": 1.5,
           "onednn_linear_speedup": 1.6, "bfloat16_mm_speedup": 0.5,
           "bfloat16_conv_speedup": 0.5, "float16_mm_speedup": 0.5,
           "float16_conv_speedup": 0.5, "float32_mm_ns_per_mac": 0.02}


@pytest.fixture
def probed(monkeypatch):
    """The detected profile with the probes answering ``float32_onednn_speedup`` as set."""
    monkeypatch.delenv("FXB_CPU_PROFILE", raising=False)
    monkeypatch.setenv("FXB_CPU_PROBES", "1")
    monkeypatch.setattr(gemm, "_chosen", {})
    figures = dict(_PROBES)
    monkeypatch.setattr(cpu, "run_probes", lambda p: figures)

    def set_speed(speed: float) -> None:
        figures["float32_onednn_speedup"] = speed
        gemm._chosen.clear()
    return set_speed


def _profile(vendor: str, cls: str = "avx512", probes: bool = True) -> cpu.CpuProfile:
    """A detected profile of class ``cls`` from ``vendor`` (the probes: the fixture's)."""
    return cpu.CpuProfile("AVX2" if cls == "avx2" else "AVX512", cpu.CLASSES[cls], 2,
                          "test CPU", "detected", probes, vendor)


@needs_onednn
@pytest.mark.parametrize("vendor", ["GenuineIntel", "unknown"])
@pytest.mark.parametrize("speed,want", [(2.2, "onednn"), (1.1, "native"), (0.6, "native")])
def test_the_probe_decides(probed, vendor, speed, want):
    probed(speed)
    for cls in ("avx2", "avx512", "amx"):
        d = _profile(vendor, cls).decide("float32_gemm")
        assert d.choice == want and f"{speed:.2f}x" in d.reason
    if speed != 1.1:  # the detected profile decides the same on any host at these figures
        assert gemm.uses_onednn() == (want == "onednn")


@needs_onednn
@pytest.mark.parametrize("speed,want", [(2.2, "onednn"), (1.05, "onednn"), (0.9, "onednn"),
                                        (0.6, "native")])
def test_on_amd_with_avx512_onednn_unless_measured_slower(probed, speed, want):
    # MKL runs no AVX-512 code on AMD CPUs: oneDNN's linear, unless the probe measures it
    # slower than torch.addmm by the margin
    probed(speed)
    d = _profile("AuthenticAMD").decide("float32_gemm")
    assert d.choice == want and f"{speed:.2f}x" in d.reason
    if want == "onednn" and speed < cpu.MARGIN:
        assert "AuthenticAMD" in d.reason
    # without AVX-512 (MKL's AVX2 kernels are as wide as oneDNN's) the probe's margin holds
    assert _profile("AuthenticAMD", "avx2").decide("float32_gemm").choice == \
        ("onednn" if speed >= cpu.MARGIN else "native")


def test_without_probes_or_with_an_override_the_vendor_rule_alone(monkeypatch):
    monkeypatch.setattr(gemm, "_chosen", {})
    for name in cpu.CLASSES:  # a class names features, not a vendor: no rule, no probe
        monkeypatch.setenv("FXB_CPU_PROFILE", name)
        assert fxbackend.cpu_profile().vendor == "unknown"
        assert fxbackend.cpu_profile().decide("float32_gemm").choice == "native"
    monkeypatch.delenv("FXB_CPU_PROFILE")
    for vendor in ("GenuineIntel", "unknown"):
        assert _profile(vendor, probes=False).decide("float32_gemm").choice == "native"
    assert _profile("AuthenticAMD", "avx2", probes=False).decide("float32_gemm").choice == \
        "native"
    want = "onednn" if cpu.onednn_float32_linear_available() else "native"
    d = _profile("AuthenticAMD", probes=False).decide("float32_gemm")
    assert d.choice == want and "measured" not in d.reason


def test_an_unavailable_onednn_is_never_chosen(probed, monkeypatch):
    probed(5.0)
    monkeypatch.setattr(cpu, "onednn_float32_linear_available", lambda: False)
    assert fxbackend.cpu_profile().decide("float32_gemm").choice == "native"


@needs_onednn
@pytest.mark.parametrize("m,k,n,bias", [(1, 8, 4, True), (37, 64, 96, False),
                                        (300, 384, 1536, True)])
def test_gemm_into_matches_addmm(probed, m, k, n, bias):
    probed(2.0)
    g = torch.Generator().manual_seed(m)
    x, w = torch.randn(m, k, generator=g), torch.randn(n, k, generator=g)
    b = torch.randn(n, generator=g) if bias else None
    y = torch.full((m, n), float("nan"))
    assert gemm.onednn_gemm_into(y, x, w.t(), b)
    want = torch.mm(x, w.t()) if b is None else torch.addmm(b, x, w.t())
    torch.testing.assert_close(y, want, rtol=1e-5, atol=1e-5 * k ** 0.5)


@needs_onednn
def test_gemm_into_declines_what_it_does_not_take(probed):
    probed(2.0)
    x, w = torch.randn(8, 16), torch.randn(4, 16)
    y = torch.empty(8, 4)
    assert not gemm.onednn_gemm_into(y, x, w.t().contiguous().t().t(), None)  # not a t(w)
    assert not gemm.onednn_gemm_into(y, x, w.t(), None, beta=0.5)
    assert not gemm.onednn_gemm_into(y.double(), x.double(), w.double().t(), None)
    assert not gemm.onednn_gemm_into(y, x.t().contiguous().t(), w.t(), None)  # x strided
    probed(0.5)  # the profile keeps torch.addmm (any vendor)
    assert not gemm.onednn_gemm_into(y, x, w.t(), None)


class _Block(torch.nn.Module):
    """A linear with and without bias, a tanh-GELU feed-forward and a gated residual: the
    native addmm/mm steps and the fused chains that run a GEMM."""

    def __init__(self, d=64):
        super().__init__()
        self.q, self.k = torch.nn.Linear(d, d), torch.nn.Linear(d, d, bias=False)
        self.up, self.down = torch.nn.Linear(d, 4 * d), torch.nn.Linear(4 * d, d)

    def forward(self, x, gate):
        h = self.q(x) * self.k(x)
        h = self.down(torch.nn.functional.gelu(self.up(h), approximate="tanh"))
        return x + gate * h


@needs_onednn
def test_models_match_eager_and_see_weight_changes(probed):
    probed(2.0)
    torch.manual_seed(0)
    model = _Block().eval()
    x, gate = torch.randn(2, 7, 64), torch.randn(64)
    fxbackend.reset_stats()
    with torch.no_grad():
        report = fxbackend.explain(model, x, gate)
        assert "cpu decision float32_gemm: onednn" in report
        fn = torch.compile(model, backend="fxbackend")
        torch.testing.assert_close(fn(x, gate), model(x, gate), rtol=1e-5, atol=1e-5)
        kernels = fxbackend.stats()["steps_by_kernel"]
        assert kernels.get("addmm_onednn_cpu", 0) + kernels.get("mm_onednn_cpu", 0) >= 1
        model.q.weight.data.mul_(0.5)  # no version counter bump: read as it is every call
        model.up.weight.data.add_(0.01)
        torch.testing.assert_close(fn(x, gate), model(x, gate), rtol=1e-5, atol=1e-5)


@needs_onednn
@pytest.mark.parametrize("family", ["flux", "sd3"])
def test_tiny_models_match_eager(probed, family):
    probed(2.0)
    model = fxbackend.models.build_model(family, "tiny")
    inputs = fxbackend.models.make_inputs(family, "tiny")
    fxbackend.reset_stats()
    with torch.no_grad():
        ref = fxbackend.models.run_eager(model, inputs)[0]
        out = fxbackend.models.run_eager(torch.compile(model, backend="fxbackend"), inputs)[0]
    assert fxbackend.stats()["steps_by_kernel"].get("addmm_onednn_cpu", 0) > 0
    torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-4)


@needs_onednn
def test_the_gemm_benchmark_runs_and_prints_the_profile():
    import pathlib
    import subprocess
    import sys
    script = pathlib.Path(__file__).resolve().parent.parent / "scripts" / "bench_gemm.py"
    out = subprocess.run([sys.executable, str(script), "--families", "flux", "--size", "tiny",
                          "--rounds", "6", "--calls", "1", "--per-shape"],
                         capture_output=True, text=True, timeout=300, check=True).stdout
    assert out.startswith("# cpu profile (")
    assert "# cpu decision float32_gemm: " in out
    assert "[flux/tiny] addmm / onednn+copy: " in out and "ms per forward" in out
    assert " x [" in out  # the per-shape lines
