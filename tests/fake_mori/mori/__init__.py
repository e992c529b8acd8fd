"""A stand-in for AMD's MoRI package (``amd-mori`` 1.2.4) for CPU tests of the MoRI provider.

It has the Python API the provider uses (``mori.ops`` v1 and ``mori.ops.dispatch_combine_v2``,
``mori.cco``, ``mori.shmem``) with the real package's signatures, defaults and behaviour as read from
its sources: persistent output buffers, op-held routing, AsyncLL's destination arithmetic and the
per-architecture combine numerics. Data moves with torch.distributed collectives; a test parses the
real wheel and fails where this API drifts from it (tests/providers/test_mori_api.py).
"""

from mori import cco, jit, ops, shmem

__all__ = ["cco", "jit", "ops", "shmem"]
