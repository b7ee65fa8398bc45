"""Test session setup.

Without a GPU, Triton kernels run in Triton's CPU interpreter: the variable
must be set before any kernel is defined, so it is set here, first.
"""
import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402


@pytest.fixture(autouse=True)
def _seeded():
    torch.manual_seed(0)
    yield
