"""Fuzzing harness of yirage (GitHub issue 6): no input may crash the process, hang, or raise
anything but yirage's own exceptions (yirage/errors.py).

- seeds.py: tiny valid seed models, built at test time (a GGUF with the default model's
  metadata and tokenizer, a sharded safetensors Llama directory).
- mutate.py: deterministic mutation recipes by category and ``apply_recipe``.
- worker.py / runner.py: mutants run in forked children of worker processes; outcomes classified
  (clean_error, identical, changed, nonfinite, crash, hang, other_exception, harness_error).
- campaign.py: ``make fuzz``; saves failing recipes under regressions/.
- graphs.py / graph_server.py: kernel-graph cases for tests/test_fuzz_graphs.py, run in a
  guarded child process.

Tests: tests/test_fuzz_models.py, tests/test_fuzz_graphs.py, tests/test_fuzz_regressions.py.
"""
