"""Programmatic dependent launch (PDL, NVIDIA sm_90 and later) for the Triton kernels of a round.

A decode round is a chain of a few hundred small kernels, each reading what the one before
wrote. Between two of them the device sits idle while the second is launched and its programs
start. A kernel launched with PDL (``launch_pdl=True``) may start while the kernel before it in
the stream is still running: its programs become resident early and wait in
:func:`wait_for_previous` (``griddepcontrol.wait``), which returns once the previous kernel has
finished and its writes are visible. So a kernel that calls it first thing, before any load or
store, computes exactly what it computes without PDL; only the launch overlaps.

Rules every PDL kernel here keeps:

- it calls :func:`wait_for_previous` before its first load and its first store (the wait covers
  every earlier kernel: each waited for the one before it);
- :func:`wait_for_previous` then lets the next kernel start
  (``griddepcontrol.launch_dependents``): that kernel waits for this one's end in turn.

``PDL`` is a constexpr: off, the kernel holds no PDL instruction, as on the CPU interpreter and
triton-ascend. The cuda backend turns it on where the device supports it
(``POLYSPEC_CUDA_PDL``, docs/backends/cuda.md).
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def wait_for_previous(PDL: tl.constexpr):
    """With ``PDL``: wait until the previous kernel in the stream has finished and its writes
    are visible, then let the next kernel start. Without: nothing."""
    if PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()


def launch_options(pdl: bool) -> dict[str, bool]:
    """The launch keyword that starts a kernel early (empty without PDL, so Triton builds that
    do not know the option never see it)."""
    return {"launch_pdl": True} if pdl else {}
