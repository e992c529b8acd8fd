"""SGLang integration: ``--moe-a2a-backend mori`` runs through mori-sglang.

``plugin.register`` is SGLang's general-plugin entry point (group ``sglang.srt.plugins``); it swaps
SGLang's ``MoriEPDispatcher`` for ``dispatcher.MoriSglangDispatcher``, which keeps the upstream
contract and drives ``EpDispatchCombineOp``. Importing this package does not import SGLang: the entry
point is loaded in every SGLang process, and only ``register`` needs SGLang itself.
"""
