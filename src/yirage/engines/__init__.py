"""Engines: what users call (``yr.LLM``); they drive models through the runtime."""
