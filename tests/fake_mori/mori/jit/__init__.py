"""``mori.jit``: only the architecture query the ops consult."""

from mori.jit import config

__all__ = ["config"]
