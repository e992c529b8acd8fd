"""``mori.jit.config``: the GPU architecture the stand-in pretends to run on (``FAKE_MORI_ARCH``)."""

from mori import _numerics


def detect_gpu_arch() -> str:
    return _numerics.arch()
