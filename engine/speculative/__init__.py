"""Speculative decoding without a draft model.

A decoding sequence guesses its next tokens (prompt_lookup: n-gram matches in its own prompt and output;
suffix_index: runs of recent requests' outputs), the scheduler feeds its last token and the guesses as one
query of 1 + k tokens beside the other decodes, the sampler samples every position of that query exactly as plain
decoding would have (verify_rows builds each position's parameters), and acceptance keeps the guesses up to the
first that differs from what was sampled, plus that sampled token. The KV of rejected guesses is never counted
as computed, so it is overwritten and never offered to the prefix cache.
"""
