"""vLLM integration: ``--all2all-backend mori_high_throughput|mori_low_latency`` on any GPU.

vLLM loads ``plugin.register`` through its ``vllm.general_plugins`` entry point in every process; the
other modules import vLLM and are only imported from there (or by tests that have vLLM installed).
"""
