"""Code generation: one module per target language (C++ for CPU; Triton and Metal later)."""
