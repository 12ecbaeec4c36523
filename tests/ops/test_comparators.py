"""The per-op comparators for outputs PyTorch defines only up to sign (onnxmedic.ops.testing).

Each must accept every valid answer (columns negated, another basis of a repeated eigenspace)
and reject wrong ones, so that the OpInfo harness reports neither false nor silent mismatches.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from onnxmedic.ops.testing import (
    EIGH_COMPARATOR,
    SVD_COMPARATOR,
    TORCH_SVD_COMPARATOR,
    check_call,
    comparator_for,
)


def _ok(comps) -> bool:
    return all(c.ok for c in comps)


def _sym(n: int, seed: int = 0) -> np.ndarray:
    a = np.random.default_rng(seed).standard_normal((n, n)).astype(np.float32)
    return a + a.T


def test_eigh_accepts_negated_columns_and_rejects_wrong_vectors():
    w, v = np.linalg.eigh(_sym(5).astype(np.float64))
    w, v = w.astype(np.float32), v.astype(np.float32)
    flipped = v * np.array([1, -1, 1, -1, -1], dtype=np.float32)
    assert _ok(EIGH_COMPARATOR([w, v], [w, flipped]))
    # elementwise, the same answer is a mismatch: what the harness reported before
    assert not np.allclose(v, flipped)
    swapped = v[:, [1, 0, 2, 3, 4]]  # orthonormal, but the wrong vector for w[0] and w[1]
    comps = EIGH_COMPARATOR([w, v], [w, swapped])
    assert not _ok(comps)
    assert {c.name for c in comps if not c.ok} >= {"out1: V diag(w) V^T"}
    assert not _ok(EIGH_COMPARATOR([w, v], [w * 1.01, flipped]))  # eigenvalues elementwise
    assert not _ok(EIGH_COMPARATOR([w, v], [w, flipped * 1.01]))  # not orthonormal


def test_eigh_accepts_any_basis_of_a_repeated_eigenvalue():
    q, _ = np.linalg.qr(np.random.default_rng(1).standard_normal((4, 4)))
    w = np.array([1.0, 2.0, 2.0, 5.0])
    c, s = np.cos(0.7), np.sin(0.7)
    rot = np.eye(4)
    rot[1:3, 1:3] = [[c, -s], [s, c]]  # a rotation inside the eigenspace of 2.0
    v2 = q @ rot
    assert _ok(EIGH_COMPARATOR([w.astype(np.float32), q.astype(np.float32)],
                               [w.astype(np.float32), v2.astype(np.float32)]))
    rot_bad = np.eye(4)
    rot_bad[0:2, 0:2] = [[c, -s], [s, c]]  # mixes the eigenvectors of 1.0 and 2.0: wrong
    assert not _ok(EIGH_COMPARATOR([w.astype(np.float32), q.astype(np.float32)],
                                   [w.astype(np.float32), (q @ rot_bad).astype(np.float32)]))


@pytest.mark.parametrize("shape", [(6, 4), (4, 6), (2, 5, 5)])
@pytest.mark.parametrize("full", [False, True])
def test_svd_accepts_shared_sign_flips_only(shape, full):
    a = np.random.default_rng(2).standard_normal(shape)
    u, s, vh = np.linalg.svd(a, full_matrices=full)
    k = s.shape[-1]
    flip = np.where(np.arange(k) % 2 == 0, -1.0, 1.0)
    u2, vh2 = u.copy(), vh.copy()
    u2[..., :, :k] *= flip
    vh2[..., :k, :] *= flip[:, None]
    f32 = [x.astype(np.float32) for x in (u, s, vh)]
    assert _ok(SVD_COMPARATOR(f32, [x.astype(np.float32) for x in (u2, s, vh2)]))
    u3 = u.copy()
    u3[..., :, 0] *= -1  # U column negated without its Vh row: U diag(S) Vh is wrong
    assert not _ok(SVD_COMPARATOR(f32, [x.astype(np.float32) for x in (u3, s, vh)]))


def test_torch_svd_comparator_reads_v_not_vh():
    a = torch.randn(5, 3, generator=torch.Generator().manual_seed(0))
    u, s, v = torch.svd(a)
    flip = torch.tensor([-1.0, 1.0, -1.0])
    assert _ok(TORCH_SVD_COMPARATOR([u.numpy(), s.numpy(), v.numpy()],
                                    [(u * flip).numpy(), s.numpy(), (v * flip).numpy()]))
    assert not _ok(SVD_COMPARATOR([u.numpy(), s.numpy(), v.numpy()],
                                  [(u * flip).numpy(), s.numpy(), (v * flip).numpy()]))


def test_comparator_registry_names_the_up_to_sign_ops():
    assert comparator_for("linalg.eigh") is EIGH_COMPARATOR
    assert comparator_for("linalg.svd") is SVD_COMPARATOR
    assert comparator_for("svd") is TORCH_SVD_COMPARATOR
    assert comparator_for("linalg.qr") is None  # Q and R match LAPACK's signs: elementwise
    assert comparator_for("linalg.eigvalsh") is None


def test_check_call_labels_results_of_a_comparator():
    """linalg.eigh's OpInfo sample: elementwise a (false) silent mismatch, with the
    comparator a pass labelled with the comparator's name."""
    a = torch.randn(5, 5, generator=torch.Generator().manual_seed(0))
    plain = check_call(torch.linalg.eigh, (a,), {"UPLO": "U"})
    assert plain.stage == "compare" and plain.comparator == ""
    res = check_call(torch.linalg.eigh, (a,), {"UPLO": "U"}, comparator=EIGH_COMPARATOR)
    assert res.ok, res.error
    assert res.comparator == "eigh-up-to-sign"
    names = [c.name for c in res.comparisons]
    assert "out1: V diag(w) V^T" in names and "out1: V^T V = I" in names


def test_normwise_comparator_scales_atol_by_the_result():
    """An FFT/matrix_exp output element that cancels to ~0 may carry an error of the result's
    scale: passes normwise, fails elementwise; a wrong large element still fails."""
    from onnxmedic.ops.testing import NORMWISE_COMPARATOR, comparator_for

    e = np.array([40.0, -25.0, 1e-6, 3.0], dtype=np.float32)
    a = e.copy()
    a[2] = 4e-5  # 4e-5 off on a ~0 element: 1e-6 of the output's scale
    assert all(c.ok for c in NORMWISE_COMPARATOR([e], [a]))
    from onnxmedic.verify.compare import compare_arrays
    assert not compare_arrays("y", e, a).ok
    b = e.copy()
    b[0] = 40.1  # 2.5e-3 relative on the largest element
    assert not all(c.ok for c in NORMWISE_COMPARATOR([e], [b]))
    nan = np.array([np.nan, 1.0], dtype=np.float32)
    assert not all(c.ok for c in NORMWISE_COMPARATOR([nan], [np.array([0.0, 1.0], np.float32)]))
    assert comparator_for("fft.rfft2") is NORMWISE_COMPARATOR
    assert comparator_for("matrix_exp") is NORMWISE_COMPARATOR
    assert comparator_for("add") is None
