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
else:
    # One test process builds engines for many models, dtypes and shapes, and each compiles
    # the fused torch references again (layers.fused: q/k norms are 3-D, hidden norms 2-D, in
    # three dtypes): more variants of one function than dynamo's default limit of 8, which a
    # serving process (one model, one dtype) stays far below. (Importing dynamo imports
    # Triton, so never before the interpreter is chosen above.)
    torch._dynamo.config.recompile_limit = 64


# Clients of a module's `server` fixture (a tests.test_server_e2e.ServerProcess started with
# --api-key tests.test_server_e2e.KEY): the openai SDK, and httpx for raw requests.
@pytest.fixture(scope="module")
def client(server):
    from tests.test_server_e2e import sdk_client

    return sdk_client(server.url)


@pytest.fixture(scope="module")
def http(server):
    from tests.test_server_e2e import http_client

    with http_client(server.url) as c:
        yield c
