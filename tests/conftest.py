"""Tests marked `cuda` need a CUDA GPU and skip without one; `pytest -m cuda` selects just
them (the campaign's tests stage, tools/campaign/call.py)."""
import numpy as np
import pytest
import torch


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if item.get_closest_marker("cuda") is not None:
            item.add_marker(skip)


@pytest.fixture(scope="session", autouse=True)
def compile_cache_secret(tmp_path_factory):
    """The secret that signs compile caches (core/cache_trust.py), in a folder of the
    session's: a compiled test run never makes one in the user's ~/.cache. Subprocesses
    inherit it."""
    from resmlp.core.cache_trust import SECRET_ENV
    with pytest.MonkeyPatch.context() as mp:
        path = tmp_path_factory.mktemp("secret") / "compile_cache.secret"
        mp.setenv(SECRET_ENV, str(path))
        yield path


@pytest.fixture(scope="session")
def short_knn(tmp_path_factory) -> list[str]:
    """Overrides that judge a DINO run on a small labeled image folder (eval.data, eval.root):
    the trainer's own k-NN (knn_report over online_knn) then costs little, so a test of the
    trainer need not stub it. A stub's hand-written result drifts from what the trainer reads
    (one without knn_k hid a KeyError in ssl/train.py's summarize until a GPU ran it)."""
    from test_folder import labeled
    root = labeled(tmp_path_factory.mktemp("short_knn"), per_class=12)  # a bank for knn.k=20
    return ["eval.data=imagefolder", f"eval.root={root}"]


@pytest.fixture
def fake_forward(monkeypatch):
    """Fakes only the network's forward passes in feature extraction (resmlp.eval.features.
    extract_features): each image of the loader's dataset gets seeded features near a point of
    its class, and its own label. The k-NN code above it (online_knn, the trainer's
    knn_report) composes its results as it does in training."""
    from resmlp.eval import features
    g = torch.Generator().manual_seed(0)

    def extract_features(model, loader, device, amp_dtype=None, n_last_blocks=1, desc="features"):
        labels = torch.as_tensor(np.asarray(loader.dataset.targets), dtype=torch.long)
        return torch.randn(len(labels), 5, generator=g) + 2 * labels[:, None].float(), labels
    monkeypatch.setattr(features, "extract_features", extract_features)
    monkeypatch.setattr(features, "feature_width", lambda *args, **kwargs: 5)   # the bank's plan: no forward either
