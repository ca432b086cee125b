"""The linear probe's lbfgs protocol (eval/logreg.py, eval/linear.py): at the optimum
scikit-learn finds on the same problem, its L2 chosen without the test split, the held-out
draw, the chunked sums, the memory plan, and the settings refused in one line."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from omegaconf import OmegaConf

from resmlp.core.config import CONFIG_DIR
from resmlp.core.errors import UserError
from resmlp.eval import logreg
from resmlp.eval.linear import lbfgs_on_features, linear_few_labels, probe_settings

CLASSES, DIM = 6, 12
GRID = (1e-4, 1e-3, 1e-2, 1e-1)


def gaussians(n: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Overlapping classes (about 80% separable by a linear layer) whose dimensions differ
    in scale by three orders of magnitude and sit far from zero, as frozen features do."""
    g = torch.Generator().manual_seed(0)                           # the classes: the same for every split
    centers = 0.5 * torch.randn(CLASSES, DIM, generator=g)
    scale = torch.logspace(-2, 1, DIM)
    offset = 5 * torch.randn(DIM, generator=g)
    g.manual_seed(seed)
    y = torch.randint(0, CLASSES, (n,), generator=g)
    x = (centers[y] + torch.randn(n, DIM, generator=g)) * scale + offset
    return x, y


@pytest.fixture(scope="module")
def fixture():
    return gaussians(1500, 1), gaussians(1000, 2)


def sklearn_tuned(x, y, tx, ty, fit_rows, held_rows) -> tuple[float, float, object]:
    """scikit-learn's LogisticRegression (lbfgs) on the same standardized features, tuned on
    the same held-out rows by the same rule: (test top-1, its L2, its refitted model)."""
    from sklearn.linear_model import LogisticRegression
    from sklearn.preprocessing import StandardScaler
    X, Y = x.double().numpy(), y.numpy()

    def model(rows, l2):
        scaler = StandardScaler().fit(X[rows])
        m = LogisticRegression(C=1 / (l2 * len(rows)), tol=1e-8, max_iter=10_000).fit(scaler.transform(X[rows]), Y[rows])
        return scaler, m
    rows = []
    for l2 in GRID:
        scaler, m = model(fit_rows, l2)
        held = scaler.transform(X[held_rows])
        p = m.predict_proba(held)
        loss = -np.log(p[np.arange(len(held_rows)), Y[held_rows]]).mean()
        rows.append(((m.predict(held) == Y[held_rows]).mean() * 100, -loss, l2))
    l2 = max(rows)[2]
    scaler, m = model(np.arange(len(Y)), l2)
    return (m.predict(scaler.transform(tx.double().numpy())) == ty.numpy()).mean() * 100, l2, m


def test_lbfgs_reaches_sklearns_optimum_and_its_tuned_accuracy(fixture):
    (x, y), (tx, ty) = fixture
    res = lbfgs_on_features(x, y, tx, ty, CLASSES, GRID, holdout=0.2, max_iter=1000, seed=0, device="cpu")
    fit_rows, held_rows = logreg.holdout_split(y, 0.2, 0)
    top1, l2, m = sklearn_tuned(x, y, tx, ty, fit_rows.numpy(), held_rows.numpy())
    assert res["protocol"] == "lbfgs" and res["l2"] == l2 and res["refit"]["converged"]
    assert abs(res["top1"] - top1) <= 0.3, (res["top1"], top1)
    assert 60 < res["top1"] < 95                                     # neither chance nor separable
    # the refit's objective is scikit-learn's minimum (its weights, scored by our objective)
    whole = logreg.Rows(x, y, "cpu").standardize()
    theirs, _, _ = logreg.loss_grad(whole, torch.tensor(m.coef_.T), torch.tensor(m.intercept_), l2)
    assert res["refit"]["loss"] == pytest.approx(float(theirs), abs=1e-7)
    assert res["n_fit"] + res["n_holdout"] == 1500 and res["n_holdout"] == pytest.approx(300, abs=CLASSES)


def test_the_test_split_chooses_nothing(fixture):
    """The chosen L2 and every held-out score are the same whatever the test labels (or
    features) are; only the one test score moves."""
    (x, y), (tx, ty) = fixture
    runs = [lbfgs_on_features(x, y, tx_, ty_, CLASSES, GRID, 0.2, 1000, seed=0, device="cpu")
            for tx_, ty_ in ((tx, ty), (tx, ty[torch.randperm(len(ty), generator=torch.Generator().manual_seed(3))]),
                             (torch.randn_like(tx), ty))]
    assert len({r["l2"] for r in runs}) == 1
    assert runs[0]["per_l2"] == runs[1]["per_l2"] == runs[2]["per_l2"]
    assert runs[1]["top1"] < runs[0]["top1"] - 30                    # permuted labels: near chance
    other = lbfgs_on_features(x, y, tx, ty, CLASSES, GRID, 0.2, 1000, seed=1, device="cpu")
    assert other["per_l2"] != runs[0]["per_l2"]                      # the held-out draw follows seed=


def test_holdout_split_is_stratified_seeded_and_keeps_every_class():
    y = torch.tensor([0] * 50 + [1] * 10 + [2] * 1 + [3] * 2)
    fit, held = logreg.holdout_split(y, 0.2, 7)
    assert torch.equal(torch.sort(torch.cat([fit, held])).values, torch.arange(len(y)))
    assert torch.bincount(y[held], minlength=4).tolist() == [10, 2, 0, 0]   # round(0.2 n), all but one at most
    again = logreg.holdout_split(y, 0.2, 7)
    assert torch.equal(held, again[1]) and not torch.equal(held, logreg.holdout_split(y, 0.2, 8)[1])
    _, held = logreg.holdout_split(y, 0.5, 7, exclude=torch.arange(0, 40))
    assert held.min() >= 40 and torch.bincount(y[held], minlength=4).tolist() == [5, 5, 0, 1]


def test_chunks_give_the_same_sums(fixture, monkeypatch):
    (x, y), _ = fixture
    rows = torch.arange(0, 1500, 3)
    data = logreg.Rows(x, y, "cpu", rows).standardize()
    w, b = torch.randn(DIM, CLASSES, dtype=torch.float64), torch.randn(CLASSES, dtype=torch.float64)
    whole = logreg.loss_grad(data, w, b, 1e-2)
    monkeypatch.setattr(logreg, "CHUNK_BYTES", 7 * 8 * (DIM + 3 * CLASSES))   # chunks of 7 rows
    assert data.chunk_rows(CLASSES) == 7
    data = logreg.Rows(x, y, "cpu", rows).standardize()
    for a, b_ in zip(whole, logreg.loss_grad(data, w, b, 1e-2)):
        torch.testing.assert_close(a, b_, rtol=1e-9, atol=1e-10)


def test_a_fit_at_max_iter_is_not_chosen_and_ends_the_sweep(fixture):
    """L2 0.1 converges in about a dozen iterations, 1e-8 (from 0.1's optimum) in about two
    dozen: at max_iter=18 the second stops short, and is not chosen though its held-out
    top-1 is higher; the third is not tried."""
    (x, y), (tx, ty) = fixture
    res = lbfgs_on_features(x, y, tx, ty, CLASSES, (1e-1, 1e-8, 1e-9), 0.2, max_iter=18, seed=0, device="cpu")
    rows = {r["l2"]: r for r in res["per_l2"]}
    assert rows[0.1]["converged"] and not rows[1e-8]["converged"] and rows[1e-8]["iterations"] == 18
    assert "not tried: l2 1e-08 ended at max_iter=18" == rows[1e-9]["skipped"]
    assert rows[1e-8]["holdout_top1"] > rows[0.1]["holdout_top1"] and res["l2"] == 0.1


def test_few_labels_under_lbfgs(fixture):
    (x, y), (tx, ty) = fixture
    probe = probe_settings(OmegaConf.create({**base_settings(), "l2": list(GRID)}))
    res = linear_few_labels(x, y, tx, ty, CLASSES, [2, 10], 2, probe, seed=0, device="cpu")
    assert res["protocol"] == "lbfgs" and res["n_holdout"] > 200
    r = res["results"]["10"]
    assert r["bank"] == 10 * CLASSES and len(r["tries"]) == 2 and all(t["l2"] in GRID for t in r["tries"])
    assert res["results"]["2"]["top1"] < r["top1"]                   # more labels, a better probe


def base_settings(**over) -> dict:
    """configs/method/linear.yaml's linear section, with `over`."""
    return {**OmegaConf.to_container(OmegaConf.load(CONFIG_DIR / "method" / "linear.yaml").linear), **over}


def test_protocols_resolved_and_refused_in_one_line():
    s = lambda **over: probe_settings(OmegaConf.create(base_settings(**over)))   # noqa: E731
    assert s().protocol == "lbfgs" and s(mode="augmented").protocol == "dino"
    assert s(protocol="dino").protocol == "dino" and s(protocol="dino").lrs[-1] == 1.0
    with pytest.raises(UserError, match="the augmented probe sees new crops every step"):
        s(protocol="lbfgs", mode="augmented")
    with pytest.raises(UserError, match="drop linear.lrs, or add linear.protocol=dino"):
        s(lrs=[0.1])
    with pytest.raises(UserError, match="linear.l2="):
        s(l2=["x"])


def test_the_solver_state_is_sized_before_the_fit():
    assert logreg.plan_device(10**6, 384, 1000, "cpu", memory_gb=64) == (False, None)
    with pytest.raises(UserError, match="solver state for 4096 features x 21843 classes"):
        logreg.plan_device(10**6, 4096, 21843, "cpu", memory_gb=8)


def test_linear_command_refuses_lbfgs_with_augmentation(capsys):
    from resmlp.core.cli import main
    assert main(["linear", "timm:resmlp_12_224?random", "linear.protocol=lbfgs", "linear.mode=augmented"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "use linear.protocol=dino (or auto) with linear.mode=augmented" in err[0]


@pytest.mark.cuda
def test_features_streamed_to_the_gpu_give_the_resident_result(fixture, monkeypatch):
    """Training features over the GPU budget stay on the host, a chunk at a time each pass
    (said in one line): the same fits as with the features on the GPU, and as on the CPU."""
    (x, y), (tx, ty) = fixture
    monkeypatch.setattr(logreg, "CHUNK_BYTES", 8 * 100 * (DIM + 3 * CLASSES))       # chunks of 100 rows
    state = logreg.state_bytes(DIM, CLASSES)
    lines = []
    runs = [lbfgs_on_features(x, y, tx, ty, CLASSES, GRID, 0.2, 1000, 0, device, memory_gb, lines.append)
            for device, memory_gb in (("cuda", 1.0), ("cuda", (state + x.numel() * 2) / 2**30), ("cpu", None))]
    assert len([line for line in lines if "stay in host memory" in line]) == 1
    assert runs[0]["l2"] == runs[1]["l2"] == runs[2]["l2"]
    assert runs[0]["top1"] == runs[1]["top1"] and abs(runs[0]["top1"] - runs[2]["top1"]) <= 0.1
    assert runs[0]["refit"]["loss"] == pytest.approx(runs[2]["refit"]["loss"], abs=1e-9)
