import socket
import warnings

import pytest
import torch

warnings.filterwarnings("ignore", message=".*falling back to its reference PyTorch implementation.*")


@pytest.fixture
def padded_batch():
    """Three examples of uneven length, right-padded (lengths 16, 11, 6)."""
    gen = torch.Generator().manual_seed(1234)
    ids = torch.randint(3, 128, (3, 16), generator=gen)
    mask = torch.ones_like(ids)
    for row, length in ((1, 11), (2, 6)):
        ids[row, length:] = 0
        mask[row, length:] = 0
    return ids, mask


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double(), b.double()
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


def free_port() -> int:
    """A TCP port nobody listens on now: torchrun tests must not meet another run's rendezvous."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]
