"""The CPU profile (``fxbackend.cpu``) and the choices made from it: every decision is asserted
for each ``FXB_CPU_PROFILE`` class, on any host; the host's own profile only for what its
detection implies (never a count that holds on one machine)."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

import fxbackend
from fxbackend import cpu

pytestmark = pytest.mark.cpu_profile

#: the prepacked int8 engine a class without VNNI takes with no probe: oneDNN's where this
#: torch has it, else fbgemm's
PREPACKED = "onednn_linear" if cpu.onednn_linear_available() else "quantized_linear"
#: the int8 GEMM a class with VNNI or AMX-INT8 takes: torch._int_mm where it is exact here
#: (every real CPU measured; not with oneDNN limited to AVX2 on a CPU with VNNI, where its
#: int8 kernels saturate), else the prepacked engine
DOT = "int_mm" if cpu.int_mm_exact() else PREPACKED
#: what each class implies: (int8_gemm, bfloat16, float16)
EXPECTED = {
    "avx2": (PREPACKED, "float32", "float32"),
    "avx512": (PREPACKED, "float32", "float32"),
    "avx512_vnni": (DOT, "float32", "float32"),
    "avx512_bf16": (DOT, "native", "float32"),
    "amx": (DOT, "native", "native"),
}


@pytest.fixture
def no_probe(monkeypatch):
    """Any probe run fails the test: an override never measures the real CPU."""
    def fail():
        raise AssertionError("a probe ran")
    monkeypatch.setattr(cpu, "_measure", fail)


def test_every_class_has_an_expectation():
    assert set(EXPECTED) == set(cpu.CLASSES)


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_override_decides_from_the_class_alone(name, monkeypatch, no_probe):
    monkeypatch.setenv("FXB_CPU_PROFILE", name)
    p = fxbackend.cpu_profile()
    assert p.features == cpu.CLASSES[name]
    assert p.source == f"FXB_CPU_PROFILE={name}" and p.overridden
    assert p.isa == ("AVX2" if name == "avx2" else "AVX512")
    assert p.threads == torch.get_num_threads()
    got = tuple(p.decide(d).choice for d in ("int8_gemm", "bfloat16", "float16"))
    assert got == EXPECTED[name]
    assert p.decide("float32_gemm").choice == "native"  # only a probe chooses oneDNN's
    lines = p.report_lines()
    assert lines[0].startswith(f"cpu profile (FXB_CPU_PROFILE={name})")
    assert len(lines) == 1 + len(cpu.DECISIONS)
    assert all(line.startswith("cpu decision ") and "(" in line for line in lines[1:])


def test_an_unknown_class_names_the_variable_and_the_choices(monkeypatch):
    monkeypatch.setenv("FXB_CPU_PROFILE", "avx1024")
    with pytest.raises(ValueError, match=r"FXB_CPU_PROFILE='avx1024'.*avx2.*amx"):
        fxbackend.cpu_profile()


def test_the_detected_profile_reads_the_host():
    p = fxbackend.cpu_profile() if not os.environ.get("FXB_CPU_PROFILE") else None
    if p is None:
        pytest.skip("FXB_CPU_PROFILE is set for this run")
    assert p.source == "detected"
    assert p.isa == torch.backends.cpu.get_cpu_capability()
    assert p.features <= set(cpu.FEATURES)
    try:
        with open("/proc/cpuinfo") as f:
            vendors = [v.strip() for k, _, v in (line.partition(":") for line in f)
                       if k.strip() == "vendor_id"]
    except OSError:
        vendors = []
    assert p.vendor == (vendors[0] if vendors else "unknown")
    if p.vendor != "unknown":
        assert f"({p.vendor})" in p.summary()
    if p.isa == "AVX2":  # torch limited to AVX2: no 512-bit feature is claimed
        assert not any(f.startswith(("avx512", "amx")) for f in p.features)
    # a feature that settles a decision settles it without a probe
    if p.has("amx_int8", "avx512_vnni"):
        assert p.decide("int8_gemm").choice == "int_mm"
    if p.has("amx_bf16", "avx512_bf16"):
        assert p.decide("bfloat16").choice == "native"


def _detected(features=frozenset()) -> cpu.CpuProfile:
    return cpu.CpuProfile("AVX2", frozenset(features), 2, "test CPU", "detected")


@pytest.mark.parametrize("ratios,want", [
    ({"int_mm_speedup": 0.01, "quantized_linear_speedup": 0.9, "onednn_linear_speedup": 1.1,
      "bfloat16_mm_speedup": 0.006, "bfloat16_conv_speedup": 0.005}, ("float32", "float32")),
    ({"int_mm_speedup": 0.01, "quantized_linear_speedup": 2.4, "onednn_linear_speedup": 1.9,
      "bfloat16_mm_speedup": 0.006, "bfloat16_conv_speedup": 0.005},
     ("quantized_linear", "float32")),
    ({"int_mm_speedup": 0.01, "quantized_linear_speedup": 1.7, "onednn_linear_speedup": 2.1,
      "bfloat16_mm_speedup": 0.006, "bfloat16_conv_speedup": 0.005},
     ("onednn_linear", "float32")),
    ({"int_mm_speedup": 3.0, "quantized_linear_speedup": 2.0, "onednn_linear_speedup": 2.5,
      "bfloat16_mm_speedup": 2.0, "bfloat16_conv_speedup": 1.5}, ("int_mm", "native")),
    # within the margin: the conservative path
    ({"int_mm_speedup": 1.1, "quantized_linear_speedup": 1.15, "onednn_linear_speedup": 1.19,
      "bfloat16_mm_speedup": 4.0, "bfloat16_conv_speedup": 1.1}, ("float32", "float32")),
])
def test_probes_decide_what_features_do_not(ratios, want, monkeypatch):
    monkeypatch.setattr(cpu, "run_probes", lambda p: ratios)
    monkeypatch.setattr(cpu, "int_mm_exact", lambda: True)
    monkeypatch.setattr(cpu, "onednn_linear_available", lambda: True)
    monkeypatch.setattr(cpu, "quantized_linear_available", lambda: True)
    p = _detected()
    got = p.decide("int8_gemm"), p.decide("bfloat16")
    assert tuple(d.choice for d in got) == want
    for key, name in (("int_mm_speedup", "torch._int_mm"), ("quantized_linear_speedup",
                                                           "fbgemm"),
                      ("onednn_linear_speedup", "oneDNN")):
        assert f"{name} {ratios[key]:.2f}x" in got[0].reason  # every figure is shown


def test_an_engine_torch_lacks_is_never_chosen(monkeypatch):
    """However fast the probe found it (a cache written by another build), an engine this
    torch does not have is not taken."""
    monkeypatch.setattr(cpu, "run_probes", lambda p: {
        "int_mm_speedup": 0.01, "quantized_linear_speedup": 1.5, "onednn_linear_speedup": 2.5})
    monkeypatch.setattr(cpu, "onednn_linear_available", lambda: False)
    monkeypatch.setattr(cpu, "quantized_linear_available", lambda: True)
    assert _detected().decide("int8_gemm").choice == "quantized_linear"


def test_features_settle_without_probing(monkeypatch, no_probe):
    monkeypatch.setattr(cpu, "int_mm_exact", lambda: True)
    p = _detected({"avx2", "avx512_vnni", "avx512_bf16"})
    assert p.decide("int8_gemm").choice == "int_mm"
    assert p.decide("bfloat16").choice == "native"
    assert "avx512_bf16" in p.decide("bfloat16").reason


def test_a_saturating_int_mm_is_never_chosen(monkeypatch):
    """oneDNN's int8 kernels limited to AVX2 add u8 x s8 pairs in saturating 16 bits: however
    fast the probe finds ``torch._int_mm``, it is not taken, even with VNNI among the flags."""
    monkeypatch.setattr(cpu, "int_mm_exact", lambda: False)
    monkeypatch.setattr(cpu, "run_probes", lambda p: {"int_mm_speedup": 5.0,
                                                      "quantized_linear_speedup": 0.5,
                                                      "onednn_linear_speedup": 0.6})
    for features in ({"avx2"}, {"avx2", "avx512_vnni"}):
        d = _detected(features).decide("int8_gemm")
        assert d.choice == "float32" and "not exact here" in d.reason


@pytest.mark.parametrize("name", ["avx512_vnni", "amx"])
def test_an_override_never_takes_a_saturating_int_mm(name, monkeypatch, no_probe):
    """A class with VNNI named on a host where ``torch._int_mm`` is not exact (oneDNN limited
    to AVX2) takes the prepacked engine with 7-bit weights instead, and says why: an override
    chooses features, not wrong results."""
    monkeypatch.setenv("FXB_CPU_PROFILE", name)
    monkeypatch.setattr(cpu, "int_mm_exact", lambda: False)
    monkeypatch.setattr(cpu, "onednn_linear_available", lambda: True)
    d = fxbackend.cpu_profile().decide("int8_gemm")
    assert d.choice == "onednn_linear" and "torch._int_mm is not exact here" in d.reason
    assert cpu.int8_weight_max() == 63
    monkeypatch.setattr(cpu, "int_mm_exact", lambda: True)
    assert fxbackend.cpu_profile().decide("int8_gemm").choice == "int_mm"
    assert cpu.int8_weight_max() == 127


def test_int_mm_exactness_is_what_the_kernels_compute():
    """``int_mm_exact`` says what ``torch._int_mm`` does on this host (with the vectors this
    process has), and ``int_dot``, the references' product, is exact either way."""
    from fxbackend.patterns.int8 import int_dot
    g = torch.Generator().manual_seed(1)
    qx = torch.randint(-128, 128, (40, 96), dtype=torch.int8, generator=g)
    qw = torch.randint(-128, 128, (24, 96), dtype=torch.int8, generator=g)
    qx[:4], qw[:4] = 127, -128
    want = qx.long() @ qw.long().t()
    assert torch.equal(torch._int_mm(qx, qw.t()).long(), want) == cpu.int_mm_exact()
    assert torch.equal(int_dot(qx, qw).long(), want)


def test_probes_off_take_the_conservative_path(monkeypatch, no_probe):
    p = cpu.CpuProfile("AVX2", frozenset({"avx2"}), 2, "test CPU", "detected",
                       probes_enabled=False)
    monkeypatch.setattr(cpu, "onednn_linear_available", lambda: True)
    assert p.decide("int8_gemm").choice == "onednn_linear"  # the engines' AVX2 kernels
    assert p.decide("float16").choice == "float32"
    monkeypatch.setattr(cpu, "onednn_linear_available", lambda: False)
    assert p.decide("int8_gemm").choice == "quantized_linear"
    monkeypatch.setattr(cpu, "quantized_linear_available", lambda: False)
    assert p.decide("int8_gemm").choice == "float32"
    assert "no quantized linear engine" in p.decide("int8_gemm").reason


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_weight_codes_fit_the_engine(name, monkeypatch):
    """Without VNNI the engine adds two u8 x s8 products in 16 bits: weights take 7 bits."""
    monkeypatch.setenv("FXB_CPU_PROFILE", name)
    want = 127 if EXPECTED[name][0] == "int_mm" else 63
    assert cpu.int8_weight_max() == want
    assert 2 * 255 * cpu.int8_weight_max() < 2 ** 15 or want == 127


@pytest.mark.parametrize("engine", ["quantized_linear", "onednn_linear"])
@pytest.mark.parametrize("m,k,n", [(1, 4, 4), (37, 256, 64), (300, 1024, 96), (5, 4096, 8)])
def test_prepacked_gemm_is_the_exact_integer_product(engine, m, k, n):
    """Each engine's product of int8 codes at the extremes (-128 .. 127 activations, 7-bit
    weights, pair sums at the 16-bit edge) equals the float64 one, rounded to float32 as the
    epilogue rounds int32: a new float32 ``[M, N]`` tensor."""
    if not getattr(cpu, f"{engine}_available")():
        pytest.skip(f"this torch has no {engine} engine")
    g = torch.Generator().manual_seed(m)
    qx = torch.randint(-128, 128, (m, k), dtype=torch.int8, generator=g)
    qx[0, :] = torch.tensor([-128, 127] * (k // 2), dtype=torch.int8)
    qx[-1, :] = 127
    qw = torch.randint(-63, 64, (n, k), dtype=torch.int8, generator=g)
    qw[0, :] = 63
    qw[-1, :] = -63
    pack, gemm = getattr(cpu, f"{engine}_pack"), getattr(cpu, f"{engine}_gemm")
    got = gemm(qx, pack(qw))
    want = (qx.double() @ qw.double().t()).float()
    assert got.dtype == torch.float32 and got.is_contiguous()
    assert torch.equal(got, want)


_FAKE_PROBES = {"int_mm_speedup": 0.5, "quantized_linear_speedup": 1.0,
                "onednn_linear_speedup": 1.1, "bfloat16_mm_speedup": 0.2,
                "bfloat16_conv_speedup": 0.1, "float16_mm_speedup": 0.2,
                "float16_conv_speedup": 0.1, "float32_mm_ns_per_mac": 0.02,
                "float32_onednn_speedup": 1.0}


def test_probes_are_measured_once_and_cached_on_disk(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    monkeypatch.setattr(cpu, "_probed", {})
    monkeypatch.setattr(cpu, "_load_per_core", lambda: 0.25)  # a quiet machine
    calls = []
    fake = _FAKE_PROBES
    monkeypatch.setattr(cpu, "_measure_passes",
                        lambda threads: (calls.append(1) or dict(fake), None))
    p = _detected()
    first = cpu.run_probes(p)
    assert calls == [1] and first["int_mm_speedup"] == 0.5
    saved = json.loads(open(cpu.probe_cache_path()).read())
    assert len(saved) == 1 and next(iter(saved.values()))["bfloat16_conv_speedup"] == 0.1
    monkeypatch.setattr(cpu, "_probed", {})  # a new process: read from disk, not measured
    assert cpu.run_probes(p)["int_mm_speedup"] == 0.5 and calls == [1]
    other = cpu.CpuProfile("AVX2", frozenset(), 4, "test CPU", "detected")  # threads: new key
    cpu.run_probes(other)
    assert calls == [1, 1]
    for var in cpu._LIMITS:  # another vector limit: measured again, under its own key
        monkeypatch.setattr(cpu, "_probed", {})
        with monkeypatch.context() as m:  # (only the key reads it: the probes are a stand-in)
            m.setenv(var, os.environ.get(var, "") + "-other")
            cpu.run_probes(p)
        assert len(calls) == 2 + 1 + cpu._LIMITS.index(var)
    assert "MKL_ENABLE_INSTRUCTIONS" in cpu._LIMITS


@pytest.mark.parametrize("loads", [(1.5, 0.2), (0.2, 1.0), (3.0, 3.0)])
def test_probes_measured_on_a_busy_machine_are_used_but_not_saved(tmp_path, monkeypatch, loads):
    """A load average of a core's worth per core or more, before or after the probes: this
    process uses them, the next measures again (and saves them once the machine is quiet);
    the report's summary line says so."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    monkeypatch.setattr(cpu, "_probed", {})
    readings = list(loads)
    monkeypatch.setattr(cpu, "_load_per_core", lambda: readings.pop(0) if readings else 0.1)
    calls = []
    monkeypatch.setattr(cpu, "_measure_passes",
                        lambda threads: (calls.append(1) or dict(_FAKE_PROBES), None))
    p = _detected()
    got = cpu.run_probes(p)
    assert got["int_mm_speedup"] == 0.5 and got["saved"] is False
    assert got["load_per_core"] == max(loads)
    assert not os.path.exists(cpu.probe_cache_path())
    assert cpu.run_probes(p) is got and calls == [1]  # the same process: not measured again
    assert "not saved: the machine was busy" in p.report_lines()[0]
    monkeypatch.setattr(cpu, "_probed", {})  # a new process, on a quiet machine
    again = cpu.run_probes(p)
    assert calls == [1, 1] and "saved" not in again and again["load_per_core"] == 0.1
    assert len(json.loads(open(cpu.probe_cache_path()).read())) == 1


def test_probes_are_saved_where_the_os_gives_no_load_average(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    monkeypatch.setattr(cpu, "_probed", {})
    monkeypatch.setattr(cpu, "_load_per_core", lambda: None)
    monkeypatch.setattr(cpu, "_measure_passes", lambda threads: (dict(_FAKE_PROBES), None))
    got = cpu.run_probes(_detected())
    assert "load_per_core" not in got and os.path.exists(cpu.probe_cache_path())


def test_each_probe_figure_is_the_median_of_its_passes(monkeypatch):
    """One pass spoilt by a burst of other work moves no figure; the other processes' CPU
    time is counted per second of the probes, beyond the cores this process leaves free."""
    passes = [{"a": 3.0, "b": 1.0}, {"a": 0.5, "b": 9.0}, {"a": 3.2, "b": 1.1}]
    monkeypatch.setattr(cpu, "PROBE_PASSES", 3)
    monkeypatch.setattr(cpu, "_measure", lambda: dict(passes.pop(0)))
    readings = [(100.0, 10.0), (101.0, 10.5)]  # 1.0 s busy in all, 0.5 s of it this process's
    monkeypatch.setattr(cpu, "_cpu_seconds", lambda: readings.pop(0))
    clock = iter([0.0, 0.5])  # the probes' start and end; any later reading: the end
    monkeypatch.setattr(cpu.time, "perf_counter", lambda: next(clock, 0.5))
    monkeypatch.setattr(cpu.os, "cpu_count", lambda: 2)
    got, others = cpu._measure_passes(threads=2)
    assert got == {"a": 3.0, "b": 1.1}
    assert others == pytest.approx(1.0)  # (1.0 - 0.5) / 0.5 s, no core left free


def test_other_cores_count_beyond_the_free_ones(monkeypatch):
    monkeypatch.setattr(cpu, "PROBE_PASSES", 1)
    monkeypatch.setattr(cpu, "_measure", lambda: {"a": 1.0})
    readings = [(0.0, 0.0), (8.0, 1.0)]  # others: 7 cores' worth over 1 s
    monkeypatch.setattr(cpu, "_cpu_seconds", lambda: readings.pop(0))
    clock = iter([0.0, 1.0])
    monkeypatch.setattr(cpu.time, "perf_counter", lambda: next(clock, 1.0))
    monkeypatch.setattr(cpu.os, "cpu_count", lambda: 8)
    assert cpu._measure_passes(threads=2)[1] == pytest.approx(1.0)  # 6 cores were free


@pytest.mark.parametrize("others", [0.3, 2.0])
def test_probes_measured_while_other_processes_ran_are_used_but_not_saved(
        tmp_path, monkeypatch, others):
    """A quiet load average but other processes taking a quarter of a core or more during the
    probes (the load average lags by a minute): used by this process, not saved."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    monkeypatch.setattr(cpu, "_probed", {})
    monkeypatch.setattr(cpu, "_load_per_core", lambda: 0.1)
    monkeypatch.setattr(cpu, "_measure_passes", lambda threads: (dict(_FAKE_PROBES), others))
    p = _detected()
    got = cpu.run_probes(p)
    assert got["saved"] is False and got["other_cores"] == others
    assert not os.path.exists(cpu.probe_cache_path())
    assert f"{others:.2f} of a core taken by other processes" in p.report_lines()[0]
    monkeypatch.setattr(cpu, "_probed", {})  # a new process, the others gone
    monkeypatch.setattr(cpu, "_measure_passes", lambda threads: (dict(_FAKE_PROBES), 0.02))
    again = cpu.run_probes(p)
    assert "saved" not in again and os.path.exists(cpu.probe_cache_path())


def test_probes_spoilt_by_a_burst_of_other_work_are_measured_again(tmp_path, monkeypatch):
    """The quietest of the measurements is kept; one quiet enough is saved."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    monkeypatch.setattr(cpu, "_probed", {})
    monkeypatch.setattr(cpu, "_load_per_core", lambda: 0.1)
    runs = [(0.9, 1.2), (0.4, 1.6), (0.01, 3.5), (0.0, 9.9)]  # (other cores, int8 figure)
    measured = []

    def passes(threads):
        others, figure = runs.pop(0)
        measured.append(others)
        return dict(_FAKE_PROBES, int_mm_speedup=figure), others
    monkeypatch.setattr(cpu, "_measure_passes", passes)
    monkeypatch.setattr(cpu, "BUSY_RETRIES", 2)
    got = cpu.run_probes(_detected())
    assert measured == [0.9, 0.4, 0.01]  # stops once quiet
    assert got["int_mm_speedup"] == 3.5 and got["other_cores"] == 0.01 and "saved" not in got
    assert os.path.exists(cpu.probe_cache_path())
    monkeypatch.setattr(cpu, "_probed", {})
    runs[:] = [(0.9, 1.2), (0.5, 1.6), (0.7, 1.1)]
    measured.clear()
    monkeypatch.setattr(cpu, "probe_cache_path", lambda: str(tmp_path / "other.json"))
    got = cpu.run_probes(_detected())  # busy every time: the quietest kept, not saved
    assert measured == [0.9, 0.5, 0.7] and got["int_mm_speedup"] == 1.6
    assert got["saved"] is False and not os.path.exists(tmp_path / "other.json")


def test_cpu_seconds_reads_this_machine():
    got = cpu._cpu_seconds()
    if not os.path.exists("/proc/stat"):
        assert got is None
        return
    busy, own = got
    assert busy > 0 and 0 < own <= busy + 1.0


def test_real_probes_are_quick_and_finite(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    got = cpu._measure()
    assert set(got) == cpu._PROBED_KEYS
    assert all(0 < v < float("inf") for v in got.values())


# ---------------------------------------------------------------------------------------------
# the decisions in plans


class _Mlp(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.a = torch.nn.Linear(64, 128)
        self.b = torch.nn.Linear(128, 64)

    def forward(self, x):
        return self.b(torch.nn.functional.gelu(self.a(x)))


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_w8a8_follows_the_int8_decision(name, monkeypatch):
    monkeypatch.setenv("FXB_CPU_PROFILE", name)
    torch.manual_seed(0)
    model = _Mlp().eval()
    x = torch.randn(8, 64)
    fxbackend.reset_stats()
    report = fxbackend.explain(model, x, options={"quantize": "w8a8", "quantize_min_size": 0})
    quantized = fxbackend.stats()["rewrites_by_rule"].get("quantize_w8a8", 0)
    assert quantized == 2, report
    assert f"cpu profile (FXB_CPU_PROFILE={name})" in report
    assert "cpu decision int8_gemm: " + EXPECTED[name][0] in report


def test_w8a8_declines_where_no_int8_gemm_beats_float32(monkeypatch):
    monkeypatch.setenv("FXB_CPU_PROFILE", "avx2")
    monkeypatch.setattr(cpu, "quantized_linear_available", lambda: False)
    monkeypatch.setattr(cpu, "onednn_linear_available", lambda: False)
    torch.manual_seed(0)
    fxbackend.reset_stats()
    report = fxbackend.explain(_Mlp().eval(), torch.randn(8, 64), options={"quantize": "w8a8"})
    assert fxbackend.stats()["rewrites_by_rule"].get("quantize_w8a8", 0) == 0
    assert "linear_i8" not in report and report.count("rewrite quantize_w8a8 declined") == 2
    assert "int8 GEMM on this CPU: no VNNI or AMX-INT8" in report


def _w8a8(model):
    return torch.compile(model, backend="fxbackend",
                         options={"quantize": "w8a8", "quantize_min_size": 0})


class _Sized(torch.nn.Module):
    """One linear [m, k] x [k, n] per (m, k, n): each reads an input of its own."""

    def __init__(self, shapes):
        super().__init__()
        self.shapes = shapes
        self.lins = torch.nn.ModuleList(torch.nn.Linear(k, n) for _, k, n in shapes)

    def forward(self, *xs):
        return [lin(x) for lin, x in zip(self.lins, xs)]


#: two small layers and a large one (every class's limits keep only the large one)
_SHAPES = [(1, 512, 512), (64, 64, 64), (512, 512, 512)]


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_w8a8_leaves_layers_too_small_to_gain_in_float32(name, monkeypatch):
    """The ``w8a8_layers`` decision keeps the layers whose float32 GEMM takes less than what a
    W8A8 layer adds in float32, each with its reason, and quantizes the large one;
    ``quantize_min_size`` replaces the limit (0: every layer)."""
    monkeypatch.setenv("FXB_CPU_PROFILE", name)
    limits = cpu.w8a8_limits()
    assert limits is not None and limits.source == "default"  # an override never probes
    want = [limits.why_not(m, k, n) is None for m, k, n in _SHAPES]
    assert want == [False, False, True]  # what the class's limits imply for these shapes
    torch.manual_seed(0)
    model = _Sized(_SHAPES).eval()
    xs = [torch.randn(m, k) for m, k, _ in _SHAPES]
    fxbackend.reset_stats()
    report = fxbackend.explain(model, *xs, options={"quantize": "w8a8"})
    assert fxbackend.stats()["rewrites_by_rule"].get("quantize_w8a8", 0) == 1, report
    assert f"cpu decision w8a8_layers: M*K*N >= {limits.min_macs / 1e6:.1f}M" in report
    assert report.count("(M*K*N=262,144) and the int8 GEMM (") == 2
    assert report.count("ms of it, less than the 0.2 ms a W8A8 layer adds") == 2
    fxbackend.reset_stats()
    fxbackend.explain(model, *xs, options={"quantize": "w8a8", "quantize_min_size": 0})
    assert fxbackend.stats()["rewrites_by_rule"].get("quantize_w8a8", 0) == 3
    fxbackend.reset_stats()
    report = fxbackend.explain(model, *xs, options={"quantize": "w8a8",
                                                    "quantize_min_size": 512 * 512 + 1})
    assert fxbackend.stats()["rewrites_by_rule"].get("quantize_w8a8", 0) == 1  # the option's
    # limit alone: M*K*N of the first two is 512 * 512
    assert report.count("M*K*N=262,144 below the option quantize_min_size=262,145") == 2


def test_w8a8_layer_limits_follow_the_probes(monkeypatch):
    """The limit comes from the float32 GEMM speed the probes measured and the chosen int8
    GEMM's speed-up over it (a layer gains where the GEMM time saved, float32's times
    ``1 - 1 / speedup``, exceeds what a W8A8 layer adds): on a slower float32 GEMM, or a faster
    int8 one, smaller layers are quantized; no int8 path faster than float32, no limit (every
    layer declines with the int8_gemm reason)."""
    monkeypatch.setattr(cpu, "int_mm_exact", lambda: True)
    probes = {"int_mm_speedup": 3.0, "quantized_linear_speedup": 0.5,
              "onednn_linear_speedup": 0.5, "float32_mm_ns_per_mac": 0.01}
    monkeypatch.setattr(cpu, "run_probes", lambda p: dict(probes))
    cost = cpu.W8A8_LAYER_COST_S
    p = _detected({"avx2", "avx512_vnni"})
    fast = cpu.w8a8_limits(p)
    assert fast.source == "measured" and fast.speedup == 3.0
    assert fast.min_macs == pytest.approx(cost / (0.01e-9 * (1 - 1 / 3)), abs=1)  # 30M
    assert "0.010 ns per multiply-add, int8 GEMM 3.0x faster (measured)" in \
        p.decide("w8a8_layers").reason
    probes["float32_mm_ns_per_mac"] = 0.04
    slow = cpu.w8a8_limits(p)
    assert slow.min_macs == pytest.approx(fast.min_macs / 4, rel=1e-6)
    assert fast.why_not(256, 256, 128) is not None and slow.why_not(256, 256, 128) is None
    why = fast.why_not(256, 256, 64)  # 0.042 ms of float32 GEMM, 2/3 of it saved
    assert "takes about 0.042 ms" in why and "(3.0x) would save 0.028 ms" in why
    probes["int_mm_speedup"] = 9.0  # the same float32 GEMM, a faster int8 one: smaller layers
    assert cpu.w8a8_limits(p).min_macs == pytest.approx(slow.min_macs * (2 / 3) / (8 / 9),
                                                         rel=1e-6)
    probes.update(int_mm_speedup=3.0, float32_mm_ns_per_mac=0.01)
    probes["float32_onednn_speedup"] = 2.0  # float32 layers through oneDNN: twice as fast,
    monkeypatch.setattr(cpu, "onednn_float32_linear_available", lambda: True)
    # and the int8 GEMM only 1.5x faster than that: each layer saves a quarter of what it did
    assert cpu.w8a8_limits(p).min_macs == pytest.approx(fast.min_macs * 4, rel=1e-6)
    probes["float32_onednn_speedup"] = 4.0  # an int8 GEMM below the margin against it: the
    assert cpu.w8a8_limits(p).speedup == cpu.MARGIN  # margin (the decision's floor)
    q = _detected({"avx2"})
    probes["int_mm_speedup"] = 0.5
    monkeypatch.setattr(cpu, "quantized_linear_available", lambda: False)
    assert q.decide("int8_gemm").choice == "float32"
    assert cpu.w8a8_limits(q) is None and q.decide("w8a8_layers").choice == "none"


@pytest.mark.parametrize("name", ["avx2", "avx512", "avx512_vnni", "amx"])
def test_w8a8_layer_limits_without_probes_use_each_engines_default_speedup(name, monkeypatch):
    """Under an override (no probes) the limit takes the default float32 speed and the default
    speed-up of the engine the class chooses: the prepacked engines' AVX2 kernels gain less
    than ``torch._int_mm`` with VNNI, so a layer must be larger to repay W8A8."""
    monkeypatch.setenv("FXB_CPU_PROFILE", name)
    engine = EXPECTED[name][0]
    p = cpu.cpu_profile()
    assert p.decide("int8_gemm").choice == engine
    limits = cpu.w8a8_limits(p)
    s = cpu._INT8_DEFAULT_SPEEDUP[engine]
    assert limits.source == "default" and limits.speedup == s
    assert limits.min_macs == pytest.approx(
        cpu.W8A8_LAYER_COST_S / (cpu._F32_NS_PER_MAC * 1e-9 * (1 - 1 / s)), abs=1)


def test_numba_compiles_for_a_named_cpu_only():
    """``NUMBA_CPU_NAME=haswell`` (the AVX2 check on an AVX-512 host) gives AVX2 kernels: no
    512-bit registers in the machine code."""
    code = ("import fxbackend, numpy as np\n"
            "from fxbackend.cpu_kernels._numba import import_numba\n"
            "nb = import_numba()\n"
            "@nb.njit\n"
            "def f(a):\n"
            "    for i in range(a.size):\n"
            "        a[i] = a[i] * 2.0\n"
            "f(np.ones(64, np.float32))\n"
            "print('zmm' in next(iter(f.inspect_asm().values())))\n")
    env = dict(os.environ, NUMBA_CPU_NAME="haswell", NUMBA_CACHE_DIR="")
    env.pop("NUMBA_CPU_FEATURES", None)
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True,
                         text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip().splitlines()[-1] == "False"
