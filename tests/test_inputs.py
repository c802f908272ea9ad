"""The one input validator (fxbackend.inputs.check_inputs), on hand-built input nodes, in the
three ways plans call it: a concrete plan (strides checked, plan-time scalars fixed), a
symbolic graph before planning (strides ignored), and a replayed plan (symbol ranges, derived
sizes solved, inputs relaid).  The error texts are the ones tests of those plans assert."""
from __future__ import annotations

import pytest
import sympy
import torch

from fxbackend.inputs import SymbolRange, check_inputs, is_dense, substitute
from fxbackend.ir import Node, ScalarMeta, TensorMeta
from fxbackend import ReplayError
from test_executor import _BAD as _EXECUTOR_BAD, _X, _Y

CPU = torch.device("cpu")
S0 = sympy.Symbol("s0", integer=True, positive=True)
S1 = sympy.Symbol("s1", integer=True, positive=True)


def _tensor(i: int, shape, stride=None) -> Node:
    if stride is None:
        stride = TensorMeta.contiguous(shape, torch.float32, CPU).stride
    return Node(i, "input", meta=TensorMeta(tuple(shape), tuple(stride), torch.float32, CPU),
                is_input=True)


def _size(i: int, sym) -> Node:
    n = Node(i, "input", meta=ScalarMeta(int), is_input=True)
    n.annotations["expr"] = sym
    return n


_CONCRETE = [_tensor(0, (3, 4)), _tensor(1, (3, 4))]
_LABELS = ["input 0 (x)", "input 1 (y)"]
#: the cases of tests/test_executor.py::test_direct_call_rejects_bad_inputs, with its patterns
_BAD = {**_EXECUTOR_BAD,
        "device": ((_X.to("meta"), _Y), r"input 0 \(x\): expected a tensor on cpu, got meta")}


@pytest.mark.parametrize("strides", ["check", "ignore", "relayout"])
@pytest.mark.parametrize("case", sorted(_BAD))
def test_concrete_inputs_rejected_with_the_plans_messages(case, strides):
    args, pattern = _BAD[case]
    with pytest.raises(ValueError, match=pattern):
        check_inputs(_CONCRETE, args, _LABELS, strides=strides)


def test_concrete_inputs_accepted_as_given():
    values, bind = check_inputs(_CONCRETE, [_X, _Y], _LABELS, strides="check")
    assert values[0] is _X and values[1] is _Y and bind == {}


def test_strides_checked_ignored_or_relaid():
    nodes = [_tensor(0, (4, 3))]
    t = torch.randn(3, 4).t()
    with pytest.raises(ValueError, match=r"input 0 \(x\): expected strides \(3, 1\), got "
                                         r"\(1, 4\)"):
        check_inputs(nodes, [t], ["input 0 (x)"], strides="check")
    assert check_inputs(nodes, [t], ["input 0 (x)"])[0][0] is t  # "ignore", the default
    (fixed,), _ = check_inputs(nodes, [t], ["input 0 (x)"], strides="relayout")
    assert fixed.stride() == (3, 1) and torch.equal(fixed, t)
    # an expanded input is copied too; a layout that is not dense (a slice's) is an error
    assert check_inputs(nodes, [torch.randn(3).expand(4, 3)], ["x"], strides="relayout")[0]
    sliced = [_tensor(0, (4, 3), (6, 1))]
    with pytest.raises(ValueError, match=r"input 0 \(x\): expected strides \(6, 1\)"):
        check_inputs(sliced, [torch.randn(4, 3)], ["input 0 (x)"], strides="relayout")
    # size-1 dims are free
    one = [_tensor(0, (1, 4))]
    assert check_inputs(one, [torch.randn(4, 1).t()], ["x"], strides="check")[0]


def test_symbolic_sizes_bound_and_checked():
    # the inputs Dynamo gives a dynamic graph: the sizes, then the tensor using them
    nodes = [_size(0, S0), _size(1, S1), _tensor(2, (S0, S1), (S1, 1))]
    labels = ["input 0 (s0)", "input 1 (s1)", "input 2 (x)"]
    values, bind = check_inputs(nodes, [3, 4, torch.randn(3, 4)], labels)
    assert bind == {S0: 3, S1: 4} and values[:2] == [3, 4]
    # the patterns of tests/test_executor.py::test_direct_call_symbolic_graph_validation
    with pytest.raises(ValueError, match=r"input 2 \(.*dtype"):
        check_inputs(nodes, [3, 4, torch.randn(3, 4).double()], labels)
    with pytest.raises(ValueError, match=r"input 2 \(.*same symbolic size"):
        check_inputs(nodes, [3, 4, torch.randn(5, 4)], labels)
    with pytest.raises(ValueError, match=r"input 2 \(.*expected a tensor"):
        check_inputs(nodes, [3, 4, 1.0], labels)
    with pytest.raises(ValueError, match=r"input 0 \(s0\): expected a Python int, got float"):
        check_inputs(nodes, [3.0, 4, torch.randn(3, 4)], labels)
    with pytest.raises(ValueError, match=r"input 0 \(s0\): expected a Python int, got Tensor"):
        check_inputs(nodes, [torch.tensor(3), 4, torch.randn(3, 4)], labels)


def test_fixed_scalars():
    nodes = [_size(0, S0), _tensor(1, (3,))]
    check_inputs(nodes, [3, torch.randn(3)], ["input 0 (n)", "input 1 (x)"], fixed={nodes[0]: 3})
    with pytest.raises(ValueError, match=r"input 0 \(n\): this plan was built for 3, got 4"):
        check_inputs(nodes, [4, torch.randn(3)], ["input 0 (n)", "input 1 (x)"],
                     fixed={nodes[0]: 3})


def test_replayed_plan_rules():
    """Ranges, a derived size solved (2*s0), numbers given as 0-dim tensors, the error class
    the caller names: the messages tests/test_replay.py asserts."""
    nodes = [_tensor(0, (2, 2 * S0, 8), (16 * S0, 8, 1)), _size(1, S1)]
    ranges = {S0: SymbolRange(2, 16, 3), S1: SymbolRange(1, None)}
    labels = ["input 'x'", "input 'n'"]

    def check(*values):
        return check_inputs(nodes, list(values), labels, ranges=ranges, strides="relayout",
                            scalar_tensors=True, error=ReplayError)

    values, bind = check(torch.randn(2, 10, 8), torch.tensor(7))
    assert bind == {S0: 5, S1: 7} and values[1] == 7 and type(values[1]) is int
    with pytest.raises(ReplayError, match=r"input 'x': dim 1 is 34, outside the range .* "
                                          r"\[2, 16\], i\.e\. 4 to 32"):
        check(torch.randn(2, 34, 8), 1)
    with pytest.raises(ReplayError, match=r"input 'x': dim 1 is 2, outside the range"):
        check(torch.randn(2, 2, 8), 1)
    with pytest.raises(ReplayError, match=r"input 'x': dim 1 is 7, but the plan needs it to be "
                                          r"2\*s0 for an integer"):
        check(torch.randn(2, 7, 8), 1)
    with pytest.raises(ReplayError, match=r"input 'x': dim 0 is 3, expected 2"):
        check(torch.randn(3, 6, 8), 1)
    with pytest.raises(ReplayError, match=r"input 'n' is 0, outside the range \[1, inf\]"):
        check(torch.randn(2, 6, 8), 0)


def test_a_size_no_input_determines():
    nodes = [_tensor(0, (S0 * S1,), (1,))]
    with pytest.raises(ValueError, match=r"depends on \['s0', 's1'\], which no other input"):
        check_inputs(nodes, [torch.randn(6)], ["input 'x'"])


def test_helpers():
    assert substitute(2 * S0 + 1, {S0: 3}) == 7 and type(substitute(2 * S0, {S0: 3})) is int
    assert substitute(S0 * S1, {S0: 2}) == 2 * S1 and substitute(5, {}) == 5
    assert is_dense((3, 4), (1, 3)) and is_dense((1, 4), (99, 1)) and not is_dense((3,), (2,))
    with pytest.raises(ValueError, match="strides must be one of"):
        check_inputs([], [], [], strides="copy")
