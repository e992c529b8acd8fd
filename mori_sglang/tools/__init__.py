"""Benchmark and tuning commands, run with ``python -m mori_sglang.tools.<name>``.

- ``bench``: dispatch and combine in a loopback world, against the copy roofline and the torch provider.
- ``bench_dist``: the same steps across real ranks (torchrun), beside NCCL's all_to_all.
- ``tune``: one-factor sweeps of the Triton kernels' tuning.
- ``bandwidth``: ceilings of the transport's memory access patterns.

``measure`` holds what they share for timing (device choice, synchronisation, the copy roofline, the
identity expert); ``workload`` the sweep flags the benchmarks share. The round trip
(``python -m mori_sglang.roundtrip``) stays at the package root as the front door.
"""
