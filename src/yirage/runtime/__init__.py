"""Runtime: builds generated code with the toolchain and executes compiled graphs."""
