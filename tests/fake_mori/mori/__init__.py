"""A stand-in for AMD's native MoRI package with its Python API (``mori.ops``, ``mori.shmem``), for CPU
tests of the MoRI provider. Data moves with torch.distributed collectives over the registered group;
every call checks its arguments the way MoRI's op documents them, so an adapter that passes the wrong
shapes, dtypes or kernel type fails here."""

from mori import ops, shmem

__all__ = ["ops", "shmem"]
