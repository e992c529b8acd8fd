"""Which class implements each ``config.Provider``, and building one after checking its capabilities.

Classes are imported on first use: the Triton provider needs triton, and nothing here imports a
transport the configuration did not pick.
"""

from __future__ import annotations

import importlib

from mori_sglang.config import CombineDtype, ConfigError, Provider
from mori_sglang.providers.base import EpProvider, ProviderSetup

# provider -> (module, class)
_CLASSES = {
    Provider.TORCH: ("mori_sglang.providers.torch_provider", "TorchProvider"),
    Provider.TRITON: ("mori_sglang.providers.triton_provider", "TritonProvider"),
    Provider.MORI: ("mori_sglang.providers.mori_provider", "MoriProvider"),
}


def provider_class(kind: Provider) -> type[EpProvider]:
    """The class behind a resolved provider (not ``auto``: see ``providers.resolve_provider``)."""
    module, name = _CLASSES[kind]
    return getattr(importlib.import_module(module), name)


def check_capabilities(kind: Provider, setup: ProviderSetup) -> None:
    """Refuse, naming the knob, a configuration the provider declares it cannot carry."""
    cls = provider_class(kind)
    caps, cfg = cls.capabilities, setup.config
    if cfg.dispatch_dtype not in caps.dispatch_formats:
        accepted = ", ".join(sorted(d.value for d in caps.dispatch_formats))
        raise ConfigError(
            f"SGLANG_MORI_DISPATCH_DTYPE: the {cls.display_name} provider does not carry dispatch dtype "
            f"{cfg.dispatch_dtype.value}; it accepts: {accepted}"
        )
    if cfg.combine_dtype not in caps.combine_formats:
        accepted = ", ".join(d.value for d in CombineDtype if d in caps.combine_formats)
        raise ConfigError(
            f"SGLANG_MORI_COMBINE_DTYPE: the {cls.display_name} provider does not carry combine dtype "
            f"{cfg.combine_dtype.value}; it accepts: {accepted}" + _carried_elsewhere(cfg.combine_dtype)
        )
    if cfg.mode not in caps.modes:
        raise ConfigError(f"the {cls.display_name} provider has no {cfg.mode.value} mode")
    if setup.loopback is not None and not caps.loopback:
        raise ConfigError(
            f"the {cls.display_name} provider runs on real ranks; a loopback world takes "
            + " or ".join(_loopback_providers())
        )


def build_provider(kind: Provider, setup: ProviderSetup) -> EpProvider:
    """The provider ``kind`` for one rank, after ``check_capabilities``."""
    check_capabilities(kind, setup)
    return provider_class(kind)(setup)


def _importable_classes() -> list[type[EpProvider]]:
    """The provider classes this installation can import (the Triton provider needs triton)."""
    classes = []
    for kind in _CLASSES:
        try:
            classes.append(provider_class(kind))
        except ImportError:
            continue
    return classes


def _loopback_providers() -> list[str]:
    return [cls.name for cls in _importable_classes() if cls.capabilities.loopback]


def _carried_elsewhere(dtype: CombineDtype) -> str:
    """Which other providers carry a format, with what they need for it."""
    carriers = []
    for cls in _importable_classes():
        if dtype in cls.capabilities.combine_formats:
            note = cls.capabilities.format_notes.get(dtype)
            carriers.append(f"the {cls.display_name} provider" + (f" ({note})" if note else ""))
    return f"; {dtype.value} is carried by {', '.join(carriers)}" if carriers else ""
