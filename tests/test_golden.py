"""Golden node lists: what small functions lower to, after the pipeline (fxbackend/ir.py text form).

A change in lowering or in a pass shows up here as a readable diff; regenerate with
``EXPECTTEST_ACCEPT=1 pytest tests/test_golden.py`` and review it.  Every case also checks that
the compiled function equals eager (see conftest.capture).
"""
from __future__ import annotations

import pytest
import torch
from expecttest import assert_expected_inline

from conftest import capture

pytestmark = pytest.mark.usefixtures("_no_grad")


@pytest.fixture
def _no_grad():
    with torch.no_grad():
        yield


def test_linear_gelu():
    torch.manual_seed(0)
    lin = torch.nn.Linear(8, 4)
    c = capture(lambda x: torch.nn.functional.gelu(lin(x)), torch.randn(2, 8))
    assert_expected_inline(c.text, """\
%0 = input : f32[4,8]
%1 = input : f32[4]
%2 = input : f32[2,8]
%3 = aten.t.default(%0) : f32[8,4]{1,8}  # view_of=%0
%4 = aten.addmm.default(%1, %2, %3) : f32[2,4]
%5 = aten.gelu.default(%4) : f32[2,4]  # output
return (%5)""")


def test_layer_norm_multi_output_getitem():
    torch.manual_seed(0)
    ln = torch.nn.LayerNorm(8)
    c = capture(lambda x: ln(x) * 2, torch.randn(2, 3, 8))
    assert_expected_inline(c.text, """\
%0 = input : f32[8]
%1 = input : f32[8]
%2 = input : f32[2,3,8]
%3 = aten.native_layer_norm.default(%2, %0, %1) {normalized_shape=[8], eps=1e-05} : (f32[2,3,8], f32[2,3,1], f32[2,3,1])
%4 = getitem(%3) {index=0} : f32[2,3,8]
%5 = aten.mul.Tensor(%4) {other=2} : f32[2,3,8]  # output
return (%5)""")


def test_chunk_then_mul_list_of_views():
    c = capture(lambda x: [a * (i + 1) for i, a in enumerate(x.chunk(3, dim=-1))],
                torch.randn(2, 9))
    assert_expected_inline(c.text, """\
%0 = input : f32[2,9]
%1 = aten.split.Tensor(%0) {split_size=3, dim=-1} : (f32[2,3]{9,1}, f32[2,3]{9,1}, f32[2,3]{9,1})  # view_of=%0
%2 = getitem(%1) {index=0} : f32[2,3]{9,1}
%3 = getitem(%1) {index=1} : f32[2,3]{9,1}
%4 = getitem(%1) {index=2} : f32[2,3]{9,1}
%5 = aten.mul.Tensor(%2) {other=1} : f32[2,3]  # output
%6 = aten.mul.Tensor(%3) {other=2} : f32[2,3]  # output
%7 = aten.mul.Tensor(%4) {other=3} : f32[2,3]  # output
return (%5, %6, %7)""")


def test_transpose_reshape_chain():
    # every step a view of the last, down to the input
    c = capture(lambda x: x.t().unsqueeze(0)[..., 1:].expand(2, 4, 2) * 2, torch.randn(3, 4))
    assert_expected_inline(c.text, """\
%0 = input : f32[3,4]
%1 = aten.t.default(%0) : f32[4,3]{1,4}  # view_of=%0
%2 = aten.unsqueeze.default(%1) {dim=0} : f32[1,4,3]{4,1,4}  # view_of=%1
%3 = aten.slice.Tensor(%2) {dim=2, start=1, end=9223372036854775807} : f32[1,4,2]{4,1,4}  # view_of=%2
%4 = aten.expand.default(%3) {size=[2, 4, 2]} : f32[2,4,2]{0,1,4}  # view_of=%3
%5 = aten.mul.Tensor(%4) {other=2} : f32[2,4,2]{8,1,4}  # output
return (%5)""")


def test_reshape_of_transposed_copies():
    # reshape of a non-viewable layout: clone then _unsafe_view
    c = capture(lambda x: x.view(2, 3, 4).transpose(1, 2).flatten(1) + 1, torch.randn(6, 4))
    assert_expected_inline(c.text, """\
%0 = input : f32[6,4]
%1 = aten.view.default(%0) {size=[2, 3, 4]} : f32[2,3,4]  # view_of=%0
%2 = aten.transpose.int(%1) {dim0=1, dim1=2} : f32[2,4,3]{12,1,4}  # view_of=%1
%3 = aten.clone.default(%2) {memory_format=contiguous_format} : f32[2,4,3]
%4 = aten._unsafe_view.default(%3) {size=[2, 12]} : f32[2,12]  # view_of=%3
%5 = aten.add.Tensor(%4) {other=1} : f32[2,12]  # output
return (%5)""")


def test_dynamic_shapes_sym_nodes():
    x = torch.randn(3, 4)
    c = capture(lambda x: x.reshape(x.shape[0] * x.shape[1]) * (x.shape[1] // 2), x,
                dynamic=True)
    assert_expected_inline(c.text, """\
%0 = input : int
%1 = input : int
%2 = input : f32[s77,s27]
%3 = sym.mul() {args=[%0, %1]} : int
%4 = aten.view.default(%2) {size=[%3]} : f32[s27*s77]  # view_of=%2
%5 = sym.floordiv() {args=[%1, 2]} : int
%6 = aten.mul.Tensor(%4) {other=%5} : f32[s27*s77]  # output
return (%6)""")
    graph = c.graph.graph
    assert graph.is_symbolic and c.graph.symbolic


def test_inplace_update_of_input():
    def f(x):
        x.add_(1)
        return x * 2

    x = torch.randn(4)
    c = capture(f, x)
    assert_expected_inline(c.text, """\
%0 = input : f32[4]
%1 = aten.add.Tensor(%0) {other=1} : f32[4]
%2 = aten.mul.Tensor(%1) {other=2} : f32[4]  # output
%3 = aten.copy_.default(%0, %1) : f32[4]  # inplace_of=%0
return (%2)""")
    graph = c.graph.graph
    (write,) = [n for n in graph.nodes if n.inplace_of is not None]
    assert write.inplace_of is graph.inputs[0]


def test_srcs_hold_tensors_only():
    x = torch.randn(3, 4)
    c = capture(lambda x: x * (x.shape[1] // 2), x, dynamic=True)
    bad = [f"%{n.id} {n.op} reads scalar %{s.id}" for n in c.graph.graph.nodes for s in n.srcs
           if s.is_scalar]
    assert bad == []
