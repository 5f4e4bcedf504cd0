import socket
import subprocess
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


def assert_top_rows(rows, brute, rtol: float = 1e-5) -> None:
    """`rows` `[Q, k]` are a top-k of the brute-force scores `brute` `[Q, N]` (float64): each query's rows are
    distinct and their brute-force scores equal the k largest, in order, to `rtol` of the largest magnitude.
    Comparing the indexes themselves would fail on a near-tie that float32 rounding may order either way."""
    import numpy as np

    rows, brute = np.asarray(rows), np.asarray(brute, dtype=np.float64)
    k = rows.shape[1]
    want = -np.sort(-brute, axis=1)[:, :k]
    got = np.take_along_axis(brute, rows, 1)
    assert all(len(set(r)) == k for r in rows.tolist()), rows
    assert np.allclose(got, want, rtol=0, atol=rtol * np.abs(brute).max()), (got, want)


def free_port() -> int:
    """A TCP port nobody listens on now: torchrun tests must not meet another run's rendezvous."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def run_torchrun(cmd: list[str], attempts: int = 3, **kwargs) -> subprocess.CompletedProcess:
    """`subprocess.run` of a torchrun command (`cmd[0]` is torchrun) on a free port, run again when a
    rank was killed by SIGABRT.

    Known flake (see the session note): under pytest, about one torchrun run in three has a gloo
    rank abort with "terminate called without an active exception" before any Python error; it
    has not been seen outside pytest (0 of 14 direct runs). Only that signature is retried; any
    other failure, and the equality the tests check, still fail the test."""
    for _ in range(attempts):
        res = subprocess.run([cmd[0], f"--master_port={free_port()}", *cmd[1:]], **kwargs)
        if res.returncode == 0 or "terminate called without an active exception" not in res.stderr:
            return res
    return res
