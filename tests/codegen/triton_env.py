"""Where the Triton kernels under test run: the GPU when there is one, else the CPU
through Triton's interpreter (tests/conftest.py sets TRITON_INTERPRET=1 there)."""
import pytest
import torch

from opweave.codegen.triton.kernel import available

needs_triton = pytest.mark.skipif(not available(),
                                  reason="Triton is not installed (pip install 'opweave[triton]')")


def triton_device() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"


@pytest.fixture
def no_tf32():
    """Products in full float32 on a GPU, as the CPU reference computes them."""
    if not torch.cuda.is_available():
        yield
        return
    saved = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    try:
        yield
    finally:
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = saved
