"""Fixtures of the torch.compile front end's tests: each test starts from fresh dynamo caches,
so compiled code of one test (or its recompile count) never leaks into the next."""
import pytest
import torch


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()
