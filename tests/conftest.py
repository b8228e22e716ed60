"""Settings shared by every test of the project's own suite."""

import os

import torch


def pytest_configure(config) -> None:
    """Under pytest-xdist, give each worker its share of the cores for PyTorch's intra-op
    threads, and the processes it starts the same (``OMP_NUM_THREADS``). At the default every
    worker's OpenMP team is as wide as the machine, and a team whose other threads wait for a
    core the other worker holds spins through each of the many small forwards a round makes:
    ``test_generate_dynamic_depth_flag`` took 127 s beside two busy processes on 2 cores, 12 s
    with one thread each. A value the caller set in ``OMP_NUM_THREADS`` is kept."""
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "0"))
    if workers < 2 or "OMP_NUM_THREADS" in os.environ:
        return
    threads = max(1, len(os.sched_getaffinity(0)) // workers)
    os.environ["OMP_NUM_THREADS"] = str(threads)
    torch.set_num_threads(threads)
