import os

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)

# Without a GPU, Triton kernels can only run in Triton's interpreter, which must be chosen
# before triton is first imported: the CPU tests of the Triton backend rely on this.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
