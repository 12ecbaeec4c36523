"""Ops torchlib exports silently wrong: onnxmedic's translations against PyTorch, and proof that
plain torch.onnx (torchlib) is wrong on the same inputs. See docs/miscompiles.md."""

from __future__ import annotations

import math

import pytest
import torch

import onnxmedic
from onnxmedic.ops import REGISTRY
from onnxmedic.ops.testing import check_call
from tests.ops._table import OpEntry, make_tests

inf, nan = math.inf, math.nan


def _scatter_reduce_edges(reduce: str):
    def edges(dtype: torch.dtype):
        g = torch.Generator().manual_seed(0)
        # NaN and +-inf in self and src, duplicate indices, a group that is all -inf, and
        # positions nothing is scattered to.
        self_ = torch.tensor([1.0, 2.0, 3.0, nan, 5.0, -inf, 0.0, -0.0], dtype=dtype)
        index = torch.tensor([0, 0, 1, 3, 4, 2, 5, 5])
        src = torch.tensor([nan, 1.0, -inf, 2.0, inf, 7.0, -inf, -inf], dtype=dtype)
        batched = torch.randn(2, 3, 4, generator=g, dtype=dtype)
        b_index = torch.randint(0, 3, (2, 5, 4), generator=g)
        b_src = torch.randn(2, 6, 5, generator=g, dtype=dtype)  # larger than index: cut
        big = torch.tensor([1e30, -1e30, 1e-30, 3.0], dtype=dtype)
        return [
            ((self_, 0, index, src, reduce), {"include_self": True}),
            ((self_, 0, index, src, reduce), {"include_self": False}),
            ((batched, 1, b_index, b_src, reduce), {"include_self": False}),
            ((big, 0, torch.tensor([0, 0, 2, 2, 1]), big.repeat(2)[:5] * 0.5, reduce), {}),
            ((torch.tensor(3.0, dtype=dtype), 0, torch.tensor(0), torch.tensor(5.0, dtype=dtype),
              reduce), {"include_self": False}),
            ((torch.randn(3, 4, generator=g, dtype=dtype), 0,
              torch.zeros(0, 4, dtype=torch.long), torch.randn(0, 4, dtype=dtype), reduce), {}),
        ]

    return edges


ENTRIES = [
    # float64 and integer dtypes: test_scatter_reduce_mean_other_dtypes
    OpEntry("scatter_reduce", variant=reduce, max_samples=2, edge=_scatter_reduce_edges(reduce),
            tolerance={"float32": (1e-5, 1e-6)})
    for reduce in ("sum", "prod", "mean", "amax", "amin")
]



# Inputs on which torchlib's scatter_reduce is wrong (see docs/miscompiles.md).
_G = torch.Generator().manual_seed(1)
_SELF = torch.randn(5, 4, generator=_G)
_INDEX = torch.tensor([[0, 1, 2, 3], [0, 1, 2, 3], [4, 4, 0, 0], [1, 1, 1, 1]])
_SRC = torch.randn(4, 4, generator=_G)
_WRONG = {
    "mean-include_self": ((_SELF, 0, _INDEX, _SRC, "mean"), {"include_self": True}),
    "mean-exclude_self": ((_SELF, 0, _INDEX, _SRC, "mean"), {"include_self": False}),
    "amax-exclude_self-all_-inf": (
        (torch.zeros(3), 0, torch.tensor([0, 0, 1]), torch.tensor([-inf, -inf, 2.0]), "amax"),
        {"include_self": False}),
    "amin-exclude_self-all_+inf": (
        (torch.zeros(3), 0, torch.tensor([0, 0, 1]), torch.tensor([inf, inf, 2.0]), "amin"),
        {"include_self": False}),
    "amax-nan_in_src": (
        (torch.zeros(2), 0, torch.tensor([0, 0, 1, 1]), torch.tensor([1.0, nan, nan, 1.0]),
         "amax"), {}),
    "amin-nan_in_self": (
        (torch.tensor([nan, 1.0]), 0, torch.tensor([0, 1]), torch.tensor([2.0, 0.5]), "amin"), {}),
}


@pytest.mark.parametrize("case", list(_WRONG))
def test_scatter_reduce_torchlib_is_wrong(case: str) -> None:
    args, kwargs = _WRONG[case]
    plain = check_call(torch.scatter_reduce, args, kwargs, registry=None)
    assert plain.stage == "compare", f"torchlib is no longer wrong on {case}: {plain.stage}"
    fixed = check_call(torch.scatter_reduce, args, kwargs, tolerance=(1e-5, 1e-6))
    assert fixed.ok, fixed.error
    assert fixed.max_rel <= 1e-5


def test_scatter_reduce_is_registered_as_override() -> None:
    meta = REGISTRY.get(torch.ops.aten.scatter_reduce.two)
    assert meta is not None and meta.overrides_torchlib and meta.family == "miscompiles"


@pytest.mark.parametrize("dtype", [torch.int64, torch.float64])
def test_scatter_reduce_mean_other_dtypes(dtype: torch.dtype) -> None:
    # PyTorch floor-divides integer means: -7 / 2 -> -4, not -3.
    self_ = torch.tensor([-7, 5, 0, 9], dtype=dtype)
    index = torch.tensor([0, 1, 1, 2, 2])
    src = torch.tensor([0, -3, 4, -10, 2], dtype=dtype)
    for include_self in (True, False):
        res = check_call(torch.scatter_reduce, (self_, 0, index, src, "mean"),
                         {"include_self": include_self})
        assert res.ok, res.error


class _PoolByGroup(torch.nn.Module):
    """Linear features averaged per group with scatter_reduce(mean): segment pooling."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = torch.nn.Linear(8, 4)

    def forward(self, x: torch.Tensor, group: torch.Tensor) -> torch.Tensor:
        h = torch.relu(self.proj(x))  # [N, 4]
        out = torch.zeros(3, 4, dtype=h.dtype)
        idx = group.unsqueeze(1).expand(-1, 4)
        mean = out.scatter_reduce(0, idx, h, "mean", include_self=False)
        peak = out.scatter_reduce(0, idx, h, "amax", include_self=False)
        return mean + peak


def test_scatter_reduce_in_module() -> None:
    torch.manual_seed(0)
    model = _PoolByGroup().eval()
    x = torch.randn(10, 8)
    group = torch.tensor([0, 2, 2, 1, 0, 0, 2, 1, 1, 0])
    assert check_call(model, (x, group), registry=None).stage == "compare"
    res = check_call(model, (x, group), tolerance=(1e-5, 1e-6))
    assert res.ok, res.error


# aten.copy: torchlib ignores the broadcast of src into self's shape.
def _copy_edges(dtype: torch.dtype):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(2, 3, generator=g, dtype=dtype)
    return [
        ((x, torch.tensor(2.5, dtype=dtype)), {}),
        ((x, torch.randn(3, generator=g, dtype=dtype)), {}),
        ((x, torch.randn(2, 1, generator=g, dtype=dtype)), {}),
        ((x, torch.tensor([1, -2, 3])), {}),  # int64 into float: cast and broadcast
        ((x, torch.tensor([nan, inf, -0.0], dtype=dtype)), {}),
        ((torch.empty(0, 3, dtype=dtype), torch.randn(3, generator=g, dtype=dtype)), {}),
        ((torch.tensor(1.0, dtype=dtype), torch.tensor(-4.0, dtype=dtype)), {}),
    ]


ENTRIES_COPY = [
    OpEntry("aten.copy", fn=torch.ops.aten.copy.default, use_opinfo=False, edge=_copy_edges),
    # torch decomposes linspace/logspace(Tensor, Tensor, steps=1) into aten.copy
    OpEntry("linspace", variant="tensor_overload", max_samples=6),
    OpEntry("logspace", variant="tensor_overload", max_samples=3,
            edge=lambda dt: [((torch.tensor(0.5), torch.tensor(3), 1), {"dtype": dt}),
                             ((torch.tensor(2), torch.tensor(3), 1, 2.0), {"dtype": dt})],
            tolerance={"float32": (1e-5, 1e-6)}),
]


def test_copy_torchlib_is_wrong() -> None:
    args = (torch.tensor(1.0), torch.tensor(3), 1)
    kwargs = {"dtype": torch.float32}
    plain = check_call(torch.linspace, args, kwargs, registry=None)
    assert plain.stage == "compare" and "shape [] != expected [1]" in plain.error
    assert check_call(torch.linspace, args, kwargs).ok


class _ResetBuffer(torch.nn.Module):
    """An input overwritten in place with a broadcast row (x.copy_(row)), then a Linear."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = torch.nn.Linear(4, 4)

    def forward(self, x: torch.Tensor, row: torch.Tensor) -> torch.Tensor:
        z = x.clone()
        z.copy_(row)  # row broadcast over the batch
        return self.proj(x).sum(0) + z  # [4] + [5, 4]: torchlib's z is [4], so is the sum


def test_copy_in_module() -> None:
    torch.manual_seed(0)
    model = _ResetBuffer().eval()
    args = (torch.randn(5, 4), torch.randn(4))
    plain = check_call(model, args, registry=None)
    assert plain.stage == "compare", plain.stage
    res = check_call(model, args, tolerance=(1e-5, 1e-6))
    assert res.ok, res.error



# Training-mode batch norm: torchlib normalises with the running statistics.
def _eval_mode(sample) -> str | None:
    # In eval mode torch.onnx lowers to _native_batch_norm_legit_no_training (torchlib, not
    # changed here), whose save_mean/save_rstd outputs are the running stats where PyTorch CPU
    # returns empty placeholders: no defined content to compare. The main output in eval mode
    # is checked by test_batch_norm_module_in_train_mode (model.eval()).
    args, kwargs = sample
    training = args[5] if len(args) > 5 else kwargs.get("training")
    return None if training else "eval mode: auxiliary outputs are placeholders"


ENTRIES_BN = [
    OpEntry(name, max_samples=4, skip_sample=_eval_mode, tolerance={"float32": (1e-5, 1e-5)})
    for name in ("native_batch_norm", "_native_batch_norm_legit")
]


def test_batch_norm_training_torchlib_is_wrong() -> None:
    def fn(x, w, b, rm, rv):
        return torch.nn.functional.batch_norm(x, rm, rv, w, b, training=True, momentum=0.1)

    g = torch.Generator().manual_seed(0)
    args = (torch.randn(2, 3, 4, 4, generator=g) * 3 + 1, torch.randn(3, generator=g),
            torch.randn(3, generator=g), torch.zeros(3), torch.ones(3))
    assert check_call(fn, args, registry=None).stage == "compare"
    res = check_call(fn, args, tolerance=(1e-5, 1e-5))
    assert res.ok, res.error


class _TrainBN(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = torch.nn.Linear(6, 4)
        self.bn = torch.nn.BatchNorm1d(4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.bn(self.proj(x))


def test_batch_norm_module_in_train_mode() -> None:
    torch.manual_seed(0)
    model = _TrainBN().train()
    x = torch.randn(8, 6) * 2 + 0.5
    assert check_call(model, (x,), registry=None).stage == "compare"
    res = check_call(model, (x,), tolerance=(1e-5, 1e-5))
    assert res.ok, res.error
    assert check_call(model.eval(), (x,), tolerance=(1e-5, 1e-5)).ok  # eval path unchanged




# ------------------------------------------------------------- reductions over empty sets

def _reduction_edges(dtype: torch.dtype):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(3, 4, 5, generator=g, dtype=dtype)
    return [
        ((torch.empty(3, 0, dtype=dtype),), {"dim": 1}),
        ((torch.empty(0, 4, dtype=dtype),), {"dim": (0, 1), "keepdim": True}),
        ((torch.empty(0, 4, dtype=dtype),), {}),
        ((x,), {"dim": (-1, 0)}),
        ((x,), {"dim": 1, "keepdim": True}),
        ((torch.tensor([[nan, 1.0], [inf, -inf]], dtype=dtype),), {"dim": 1}),
        ((torch.tensor(2.5, dtype=dtype),), {}),
    ]


def _var_edges(dtype: torch.dtype):
    out = _reduction_edges(dtype)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(2, 1, 3, generator=g, dtype=dtype)
    out += [((x,), {"dim": 1}),  # one element: 0/0 with correction 1
            ((x,), {"dim": 2, "correction": 0}), ((x,), {"dim": 2, "correction": 5})]
    return out


ENTRIES_EMPTY = [
    OpEntry("mean", max_samples=4, edge=_reduction_edges, dtypes=(torch.float32, torch.float64)),
    *[OpEntry(name, max_samples=4, edge=_var_edges, tolerance={"float32": (1e-5, 1e-6)})
      for name in ("var", "std", "var_mean", "std_mean")],
]


@pytest.mark.parametrize("fn", [lambda x: x.mean(dim=1), lambda x: x.mean(), lambda x: x.var(1),
                                lambda x: x.std(1), lambda x: torch.var_mean(x, 1)[0]],
                         ids=["mean.dim", "mean", "var", "std", "var_mean"])
def test_empty_reduction_torchlib_is_wrong(fn) -> None:
    """ONNX Runtime's ReduceMean of nothing is 0; PyTorch's is NaN (0/0)."""
    x = torch.empty(3, 0)
    assert not check_call(fn, (x,), registry=None).ok
    assert check_call(fn, (x,)).ok


def test_mean_with_nonempty_static_shape_is_plain_reducemean() -> None:
    """No guard where the shape proves the set is not empty: ONNX Runtime's RMSNorm/LayerNorm
    fusions match ReduceMean patterns, so the graph stays what torchlib emits."""
    from onnxmedic.ops.testing import export_call
    model, _ = export_call(lambda x: x.mean(dim=-1, keepdim=True), (torch.randn(2, 8),))
    assert [n.op_type for n in model.graph.node] == ["ReduceMean"]


make_tests(ENTRIES + ENTRIES_COPY + ENTRIES_BN + ENTRIES_EMPTY, globals())


# ----------------------------------------------------------------------------- log_sigmoid

_LOGSIG_EDGES = torch.tensor([-100.0, -88.8, -20.0, -8.5, -1e-8, -0.0, 0.0, 1e-8, 8.5, 20.0,
                              30.0, 100.0, float("nan"), float("-inf"), float("inf")])


def test_log_sigmoid_torchlib_is_wrong() -> None:
    """torchlib's Log(Sigmoid(x)): -inf below about -88 (Sigmoid underflows), and ONNX
    Runtime's Sigmoid is only ~1e-5 accurate relative for small results, so between -12 and -4
    the log is up to 5.7e-3 off (4.7e-4 relative); OpInfo's multilabel_soft_margin_loss sample
    came out 1.5e-4 off that way."""
    plain = check_call(torch.nn.functional.logsigmoid, (_LOGSIG_EDGES,), registry=None)
    assert plain.stage == "compare" and plain.max_abs == float("inf")
    ours = check_call(torch.nn.functional.logsigmoid, (_LOGSIG_EDGES,))
    assert ours.ok and ours.max_abs < 1e-6
    x = torch.linspace(-12, -4, 9)
    plain = check_call(torch.nn.functional.logsigmoid, (x,), registry=None)
    assert plain.stage == "compare" and plain.max_abs > 1e-3
    ours = check_call(torch.nn.functional.logsigmoid, (x,))
    assert ours.ok and ours.max_abs < 1e-5
    y = torch.linspace(-3, 3, 9)
    loss = torch.nn.functional.multilabel_soft_margin_loss
    assert not check_call(loss, (x, y), registry=None).ok
    assert check_call(loss, (x, y)).ok


@pytest.mark.parametrize("dtype", [torch.float64, torch.float16])  # bf16: no CPU kernels
def test_log_sigmoid_other_dtypes(dtype: torch.dtype) -> None:
    assert check_call(torch.nn.functional.logsigmoid, (_LOGSIG_EDGES.to(dtype),)).ok


def test_log_sigmoid_in_module() -> None:
    m = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.LogSigmoid()).eval()
    with torch.no_grad():
        m[0].weight.mul_(60)  # pre-activations far below -88: torchlib's model gives -inf
    r = onnxmedic.export(m, (torch.randn(3, 4) * 3,))
    assert r.ok, [f.one_paragraph() for f in r.findings]


# --------------------------------------------------------------- eval-mode batch norm outputs

def _bn_eval_cases():
    torch.manual_seed(0)
    x, rm, rv = torch.randn(3, 2, 4), torch.randn(2), torch.rand(2) + 0.5
    w, b = torch.randn(2), torch.randn(2)
    return [(x, w, b, rm, rv, False, -1.2, 1e-5), (x, None, None, rm, rv, False, 0.1, 1e-3),
            (torch.randn(5, 2), w, None, rm, rv, False, 0.1, 1e-5)]


@pytest.mark.parametrize("args", _bn_eval_cases(), ids=["affine", "no-affine", "2d"])
def test_batch_norm_eval_outputs_torchlib_is_wrong(args) -> None:
    """torch.native_batch_norm(training=False) returns empty save_mean/save_rstd (the exported
    program's metadata says [0] too); torchlib returned the running stats ([C])."""
    plain = check_call(torch.native_batch_norm, args, registry=None)
    assert plain.stage == "compare" and "!= expected [0]" in plain.error
    assert check_call(torch.native_batch_norm, args).ok


def test_batch_norm_eval_module_still_fuses_into_conv() -> None:
    m = torch.nn.Sequential(torch.nn.Conv2d(3, 4, 3), torch.nn.BatchNorm2d(4),
                            torch.nn.ReLU()).eval()
    with torch.no_grad():
        m[1].running_mean.uniform_()
        m[1].running_var.uniform_(0.5, 2)
    r = onnxmedic.export(m, (torch.randn(2, 3, 8, 8),))
    assert r.ok and [n.op_type for n in r.onnx_model.graph.node] == ["Conv", "Relu"]


# ------------------------------------------------------------- max/min reductions with NaN

_NAN_ROWS = torch.tensor([[1.0, float("nan"), 3.0], [4.0, 5.0, 6.0], [float("-inf"), 0.0, -0.0]])


@pytest.mark.parametrize("fn,kwargs", [(torch.max, {}), (torch.min, {}),
                                       (torch.aminmax, {"dim": 1})],
                         ids=["max", "min", "aminmax-dim"])
def test_nan_reductions_torchlib_is_wrong(fn, kwargs) -> None:
    """ONNX Runtime's ReduceMax/ReduceMin skip NaN; PyTorch propagates it."""
    plain = check_call(fn, (_NAN_ROWS,), kwargs, registry=None)
    assert plain.stage == "compare"
    assert check_call(fn, (_NAN_ROWS,), kwargs).ok


@pytest.mark.parametrize("dtype", [torch.float64, torch.float16, torch.int64])
@pytest.mark.parametrize("fn,kwargs", [(torch.max, {}), (torch.min, {}), (torch.aminmax, {}),
                                       (torch.aminmax, {"dim": 0, "keepdim": True})],
                         ids=["max", "min", "aminmax", "aminmax-dim0-keepdim"])
def test_nan_reductions_other_dtypes(fn, kwargs, dtype) -> None:
    x = _NAN_ROWS if dtype.is_floating_point else torch.tensor([[3, -1, 2], [0, 9, -7]])
    assert check_call(fn, (x.to(dtype),), kwargs).ok


@pytest.mark.parametrize("kwargs", [{}, {"dim": 0}, {"dim": -1, "keepdim": True}])
def test_aminmax_of_a_0d_input(kwargs) -> None:
    for v in (2.5, float("nan")):
        assert check_call(torch.aminmax, (torch.tensor(v),), kwargs).ok


def test_aminmax_without_dim_exports() -> None:
    """torchlib requires ``dim``: plain torch.onnx fails to export ``torch.aminmax(x)``."""
    x = torch.randn(3, 4)
    assert check_call(torch.aminmax, (x,), registry=None).stage == "export"
    assert check_call(torch.aminmax, (x,)).ok


# -------------------------------------------------------------- vector norm of a 0-d input

@pytest.mark.parametrize("kwargs", [{"dim": 0}, {"dim": -1, "keepdim": True},
                                    {"dim": 0, "ord": 0}, {"dim": 0, "ord": float("inf")},
                                    {"dim": 0, "ord": 3.0}])
def test_vector_norm_of_a_0d_input_torchlib_is_rejected(kwargs) -> None:
    """PyTorch treats a 0-d input with dim=0 as a 1-element vector; torchlib's ReduceL2 over
    axis 0 of a 0-d tensor is refused by ONNX Runtime (OpInfo cosine_similarity sample 3)."""
    x = torch.tensor(-1.5)
    assert check_call(torch.linalg.vector_norm, (x,), kwargs, registry=None).stage == "runtime"
    assert check_call(torch.linalg.vector_norm, (x,), kwargs).ok


def test_cosine_similarity_of_scalars() -> None:
    a, b = torch.tensor(1.5), torch.tensor(-2.0)
    f = torch.nn.functional.cosine_similarity
    assert check_call(f, (a, b), {"dim": 0}, registry=None).stage == "runtime"
    assert check_call(f, (a, b), {"dim": 0}).ok
    assert check_call(f, (torch.randn(3, 4), torch.randn(3, 4)), {"dim": 1}).ok


# --- scaled_dot_product_attention: fully masked rows, ranks other than 4 ---------------------

def _sdpa_inputs(shape, masked_row: int = 1, kind: str = "bool", seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(*shape, generator=g) for _ in range(3))
    keep = torch.rand(shape[-2], shape[-2], generator=g) > 0.3
    keep[:, 0] = True  # every other row keeps a key
    keep[masked_row] = False  # this query row sees no key (a fully padded sequence)
    mask = keep if kind == "bool" else torch.zeros(keep.shape).masked_fill(~keep, -inf)
    return q, k, v, mask


def _sdpa(q, k, v, mask):
    return torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask)


@pytest.mark.parametrize("kind", ["bool", "float"])
def test_sdpa_fully_masked_row_torchlib_is_wrong(kind: str) -> None:
    args = _sdpa_inputs((2, 2, 5, 8), kind=kind)
    assert _sdpa(*args)[:, :, 1].abs().max() == 0  # PyTorch: 0 for the row that sees nothing
    plain = check_call(_sdpa, args, registry=None)
    # bool: the mean of the values (masked with the type's lowest value); float -inf: NaN
    assert plain.stage == "compare", plain
    check = check_call(_sdpa, args)
    assert check.ok, check


@pytest.mark.parametrize("shape", [(3, 5, 8), (5, 8), (2, 3, 2, 5, 8)], ids=["3d", "2d", "5d"])
@pytest.mark.parametrize("kind", ["bool", "float", None])
def test_sdpa_of_other_ranks(shape, kind) -> None:
    q, k, v, mask = _sdpa_inputs(shape, kind=kind or "bool")
    if kind is None:
        mask = None
    plain = check_call(_sdpa, (q, k, v, mask), registry=None)
    assert not plain.ok  # torchlib: "only 4D query, key, and value are supported"
    check = check_call(_sdpa, (q, k, v, mask), tolerance=(1e-5, 1e-6))
    assert check.ok, check


@pytest.mark.parametrize("kwargs", [{"is_causal": True}, {"scale": 0.3},
                                    {"is_causal": True, "scale": 0.3}])
def test_sdpa_keeps_the_other_arguments(kwargs) -> None:
    g = torch.Generator().manual_seed(2)
    q, k, v = (torch.randn(2, 3, 6, 4, generator=g) for _ in range(3))
    for x in ((q, k, v), (q[0], k[0], v[0])):  # 4-D (torchlib's graph) and 3-D (folded)
        check = check_call(torch.nn.functional.scaled_dot_product_attention, x, kwargs,
                           tolerance=(1e-5, 1e-6))
        assert check.ok, (kwargs, check)


def test_sdpa_gqa_and_graph_unchanged_without_a_mask() -> None:
    g = torch.Generator().manual_seed(3)
    q = torch.randn(1, 4, 5, 8, generator=g)
    k, v = torch.randn(1, 2, 5, 8, generator=g), torch.randn(1, 2, 5, 8, generator=g)
    check = check_call(torch.nn.functional.scaled_dot_product_attention, (q, k, v),
                       {"enable_gqa": True}, tolerance=(1e-5, 1e-6))
    assert check.ok, check


class _PaddedEncoder(torch.nn.Module):
    """BERT-style self-attention over a padded batch, one sample entirely padding."""

    def __init__(self) -> None:
        super().__init__()
        self.qkv = torch.nn.Linear(16, 48)
        self.out = torch.nn.Linear(16, 16)

    def forward(self, x: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
        b, n, _ = x.shape
        q, k, v = self.qkv(x).view(b, n, 3, 2, 8).permute(2, 0, 3, 1, 4)
        mask = keep[:, None, None, :]  # [b, 1, 1, n]: key padding
        att = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        return self.out(att.transpose(1, 2).reshape(b, n, 16))


def test_padded_batch_with_an_empty_sample_exports_and_verifies(tmp_path) -> None:
    torch.manual_seed(0)
    keep = torch.ones(3, 6, dtype=torch.bool)
    keep[1, 4:] = False
    keep[2] = False  # a sample that is all padding: PyTorch's attention output is 0 there
    args = (torch.randn(3, 6, 16), keep)
    res = onnxmedic.export(_PaddedEncoder().eval(), args, tmp_path / "m.onnx")
    assert res.ok, [(f.code, f.message) for f in res.findings]


def test_multihead_attention_reference_is_the_exported_path(tmp_path) -> None:
    """nn.MultiheadAttention's inference fast path returns NaN for a query whose keys are all
    padded; the path torch.export captures (SDPA) returns 0. The reference follows the captured
    path, and the global fast-path switch is restored after export."""
    torch.manual_seed(0)
    mha = torch.nn.MultiheadAttention(16, 2, batch_first=True).eval()

    class M(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.mha = mha

        def forward(self, x, pad):
            return self.mha(x, x, x, key_padding_mask=pad, need_weights=False)[0]

    pad = torch.zeros(2, 5, dtype=torch.bool)
    pad[1] = True
    x = torch.randn(2, 5, 16)
    with torch.no_grad():
        assert M()(x, pad)[1].isnan().all()  # the fast path
    assert torch.backends.mha.get_fastpath_enabled()
    res = onnxmedic.export(M().eval(), (x, pad), tmp_path / "m.onnx")
    assert res.ok, [(f.code, f.message) for f in res.findings]
    assert torch.backends.mha.get_fastpath_enabled()


# --- grid_sample: NaN/inf coordinates and far coordinates with border padding ----------------

def _grid_with_edges(reflection: bool):
    g = torch.Generator().manual_seed(4)
    vals = [inf, -inf, nan, 1e10, -1e10, 1.3, -1.7, 0.99]
    grid = torch.rand(2, 3, len(vals) * 2, 2, generator=g) * 2.4 - 1.2
    for i, v in enumerate(vals):
        if reflection and abs(v) > 1e6:
            continue  # documented: not reproduced (both sides lose every digit there)
        grid[:, 0, 2 * i, 0] = v
        grid[:, 1, 2 * i + 1, 1] = v
    return torch.randn(2, 3, 4, 5, generator=g), grid


@pytest.mark.parametrize("align_corners", [False, True])
@pytest.mark.parametrize("padding", ["zeros", "border", "reflection"])
@pytest.mark.parametrize("mode", ["bilinear", "nearest", "bicubic"])
def test_grid_sample_non_finite_and_far_coordinates(mode, padding, align_corners) -> None:
    args = _grid_with_edges(padding == "reflection")

    def fn(x, grid):
        return torch.nn.functional.grid_sample(x, grid, mode=mode, padding_mode=padding,
                                               align_corners=align_corners)

    check = check_call(fn, args, tolerance=(1e-5, 1e-5))
    assert check.ok, check
    plain = check_call(fn, args, registry=None)
    # torchlib (plain GridSample) is right only for reflection with bilinear/nearest
    assert plain.ok == (padding == "reflection" and mode != "bicubic"), plain


def test_perspective_warp_with_a_degenerate_homography(tmp_path) -> None:
    """A projective x coordinate whose denominator reaches 0 inside the image: it goes to -inf
    there, and PyTorch's grid_sample gives NaN (zeros padding, bilinear); ONNX Runtime's
    GridSample samples a pixel."""

    class Warp(torch.nn.Module):
        def forward(self, img, h):
            b, _, hh, ww = img.shape
            ys, xs = torch.meshgrid(torch.linspace(-1, 1, hh), torch.linspace(-1, 1, ww),
                                    indexing="ij")
            pts = torch.stack([xs, ys, torch.ones_like(xs)], -1).reshape(1, -1, 3)
            p = pts @ h.transpose(1, 2)
            grid = torch.stack([p[..., 0] / p[..., 2], p[..., 1]], -1).reshape(b, hh, ww, 2)
            return torch.nn.functional.grid_sample(img, grid, align_corners=False)

    h = torch.eye(3).repeat(2, 1, 1)
    h[1, 2, 0] = 1.0  # w = x + 1: 0 at the left edge
    res = onnxmedic.export(Warp().eval(), (torch.rand(2, 3, 8, 9), h), tmp_path / "w.onnx")
    assert res.ok, [(f.code, f.message) for f in res.findings]


# -- FFTs: ONNX Runtime's float32 DFT is inaccurate at lengths that are not powers of two ------

def _rfft(x):
    return torch.view_as_real(torch.fft.rfft(x))


def _irfft(xr, n):
    return torch.fft.irfft(torch.view_as_complex(xr), n)


def _fft(zr):
    return torch.view_as_real(torch.fft.fft(torch.view_as_complex(zr)))


def _fft_call(name: str, n: int):
    g = torch.Generator().manual_seed(n)
    x = torch.randn(3, n, generator=g)
    if name == "rfft":
        return _rfft, (x,)
    if name == "irfft":
        return _irfft, (torch.view_as_real(torch.fft.rfft(x)).contiguous(), n)
    return _fft, (torch.randn(3, n, 2, generator=g),)


@pytest.mark.parametrize("n", [406, 1000, 1024, 4096])
@pytest.mark.parametrize("name", ["rfft", "irfft", "fft"])
def test_fft_within_the_float32_budget(name, n):
    from onnxmedic.ops.testing import comparator_for

    fn, args = _fft_call(name, n)
    res = check_call(fn, args, comparator=comparator_for(f"fft.{name}"))
    assert res.ok, res.error


@pytest.mark.parametrize("n", [406, 1000])
@pytest.mark.parametrize("name", ["rfft", "irfft", "fft"])
def test_torchlib_fft_outside_the_float32_budget(name, n):
    """torchlib's float32 DFT: 300-600x PyTorch's error at these lengths (normwise 4e-5 at
    406, 1.1e-4 at 1000; PyTorch ~1.5e-7)."""
    from onnxmedic.ops.testing import comparator_for

    fn, args = _fft_call(name, n)
    res = check_call(fn, args, comparator=comparator_for(f"fft.{name}"), registry=None)
    assert res.stage == "compare", (res.stage, res.error)


def test_julius_lowpass_verifies(tmp_path):
    """julius.LowPassFilters convolves by FFT above a filter size (zoo julius/lowpass: OM601,
    221x the budget, born at the DFT at length ~406)."""
    julius = pytest.importorskip("julius")
    model = julius.LowPassFilters([0.1, 0.25]).eval()
    x = torch.randn(2, 400, generator=torch.Generator().manual_seed(0))
    r = onnxmedic.export(model, (x,), tmp_path / "m.onnx",
                         dynamic_shapes=({0: "batch", 1: "samples"},))
    assert r.ok, [f.one_paragraph() for f in r.findings]
    assert all(c.ok for c in r.verification)
