import os

# One intra-op thread: the tests run engines in several processes on a 2-core machine,
# and OpenMP threads spinning against each other made tiny matmuls 200x slower.
os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import pytest
import torch

torch.set_num_threads(1)


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
