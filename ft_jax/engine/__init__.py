"""Generation: sampling.py (the sampling rule), steps.py (prefill, decode_one_token, decode_n_tokens), engine.py (the
Engine: compiled-step cache + generate) and stats.py (statistics, compile counter)."""
