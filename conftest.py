"""Repository-level pytest setup: make the checkout importable and skip `cuda` tests without a GPU."""
import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import pyengine  # noqa: E402,F401  (before torch: it sets the OpenMP spin policy)


def pytest_collection_modifyitems(config, items):
    import torch

    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs an NVIDIA GPU")
    for item in items:
        if item.get_closest_marker("cuda"):
            item.add_marker(skip)
