"""Tests marked `cuda` need a CUDA GPU and skip without one; `pytest -m cuda` selects just
them (the campaign's tests stage, bench/campaign.py)."""
import pytest
import torch


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if item.get_closest_marker("cuda") is not None:
            item.add_marker(skip)
