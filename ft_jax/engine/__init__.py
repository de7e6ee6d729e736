"""Generation: sampling.py (the sampling rule, per-row operands and keys), steps.py (prefill, decode_one_token,
decode_n_tokens), engine.py (the Engine: compiled-step cache + generate), batch.py (DecodeBatch: B rows of one KV
cache for continuous batching) and stats.py (statistics, compile counter)."""
