"""SGLang general plugin: stock ``--moe-a2a-backend mori`` runs through mori-sglang.

SGLang's ``load_plugins()`` runs every entry point of the group ``sglang.srt.plugins`` (restricted by
``SGLANG_PLUGINS`` where set) early in the launcher and in every worker, then applies the hooks
registered with its ``HookRegistry``. ``register`` adds two:

- a class replacement of ``moriep.MoriEPDispatcher`` by ``MoriSglangDispatcher``; the registry also
  rebinds the modules that imported the class by name (the dispatcher package, two-batch overlap), so
  SGLang's own factory builds ours;
- a wrapper around the ``handle_a2a_moe`` resolution step: SGLang's checks run first (the chunked
  prefill size against ``SGLANG_MORI_NUM_MAX_DISPATCH_TOKENS_PER_RANK`` among them), then, when the
  backend is mori, every variable we read is parsed, so a bad value stops the launch with its name
  instead of failing later in a worker.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from mori_sglang import env

DISPATCHER_TARGET = "sglang.srt.layers.moe.token_dispatcher.moriep.MoriEPDispatcher"
A2A_RESOLUTION_STEP = "handle_a2a_moe"

_READERS: dict[str, Callable[[str, Mapping[str, str] | None], object]] = {
    "bool": env.get_bool,
    "int": env.get_int,
    "choice": env.get_choice,
}


def register() -> None:
    """The ``sglang.srt.plugins`` entry point."""
    from sglang.srt.arg_groups.resolution_hooks import register_resolution_hook
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    from mori_sglang.integrations.sglang.dispatcher import MoriSglangDispatcher

    HookRegistry.register(DISPATCHER_TARGET, MoriSglangDispatcher, HookType.REPLACE)
    register_resolution_hook(A2A_RESOLUTION_STEP)(check_env_at_launch)


def check_env_at_launch(server_args: Any, previous: Callable[[Any], None]) -> None:
    """Resolution step wrapper: SGLang's own a2a checks, then ours when the backend is mori."""
    from sglang.srt.arg_groups.overrides import resolved_view

    previous(server_args)
    if resolved_view(server_args).moe_a2a_backend == "mori":
        check_mori_env()


def check_mori_env(environ: Mapping[str, str] | None = None) -> None:
    """Parse every variable mori-sglang reads; raises ``EnvError`` naming the first bad one."""
    for var in env.ENV_VARS:
        _READERS[var.kind](var.name, environ)
