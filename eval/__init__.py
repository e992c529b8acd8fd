"""End-to-end and layer-level accuracy tools for mori-sglang.

Run from the repository root: ``python -m eval.gsm8k``, ``python -m eval.ab``,
``python -m eval.layer_accuracy`` (see docs/eval.md).
"""
