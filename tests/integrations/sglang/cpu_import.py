"""Make stock SGLang importable on a CPU-only machine, for tests and CI.

Two things stand in the way there, neither of them in the MoE path:

- ``import sglang`` reaches ``torchvision`` (through transformers' image utilities and SGLang's
  DeepSeek-OCR config). The PyPI torchvision wheel links against the CUDA build of torch; beside a
  CPU-only torch its operator library fails to load, and its fake-kernel registrations for
  ``torchvision::nms`` / ``torchvision::qnms`` then raise "operator ... does not exist". Declaring those
  two schemas first lets the import finish. Where the operator library loads (a matching torch), we
  leave it alone.
- ``import sglang`` creates ``SGLANG_CACHE_DIR`` (default ``~/.cache/sglang``); a check run must not
  write into the user's home, so an unset variable is pointed at a temporary folder.

Call ``prepare_sglang_cpu_import()`` before the first ``import sglang``. Serving never calls it.
"""

from __future__ import annotations

import atexit
import importlib.util
import os
import shutil
import sys
import tempfile
from pathlib import Path

import torch

# torchvision declares these two unconditionally in its _meta_registrations module.
_TORCHVISION_SCHEMAS = (
    "nms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor",
    "qnms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor",
)
# Held for the life of the process: dropping a Library removes its definitions.
_stand_in: torch.library.Library | None = None


def prepare_sglang_cpu_import() -> None:
    """Point SGLang's cache at a temporary folder and declare torchvision's schemas where needed."""
    _temporary_sglang_cache()
    _declare_torchvision_schemas_if_unloadable()


def _temporary_sglang_cache() -> None:
    if "SGLANG_CACHE_DIR" in os.environ:
        return
    folder = tempfile.mkdtemp(prefix="sglang-cache-")
    os.environ["SGLANG_CACHE_DIR"] = folder
    # Spawned workers inherit the variable and exit before this process does.
    atexit.register(shutil.rmtree, folder, ignore_errors=True)


def _torchvision_ops_library() -> Path | None:
    spec = importlib.util.find_spec("torchvision")
    if spec is None or spec.origin is None:
        return None
    folder = Path(spec.origin).parent
    return next(iter(sorted(folder.glob("_C.*"))), None)


def _declare_torchvision_schemas_if_unloadable() -> None:
    global _stand_in
    if _stand_in is not None or "torchvision" in sys.modules:
        return
    library = _torchvision_ops_library()
    if library is None:
        return
    try:
        torch.ops.load_library(str(library))
    except OSError:
        _stand_in = torch.library.Library("torchvision", "DEF")
        for schema in _TORCHVISION_SCHEMAS:
            _stand_in.define(schema)
