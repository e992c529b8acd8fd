"""Few-shot GSM8K accuracy driver whose numbers compare with SGLang's benchmark/gsm8k/bench_sglang.py."""
