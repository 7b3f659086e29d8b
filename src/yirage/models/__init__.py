"""Models: short-name registry, weight/tokenizer loading, and decoders as kernel graphs."""
