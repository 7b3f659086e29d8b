"""WebGPU quantized ``linear`` and ``embedding`` over the GGUF types qblocks.wgsl's later decoders
read (q5_0, q5_1, q2_K, q3_K): every conformance case of those ops whose id names one of them
passes on webgpu with nothing run as the torch reference on the host. Without wgpu or a WebGPU
adapter the module is skipped."""
import pytest

import yirage as yr
from yirage.backends import get_backend_info

if not yr.is_backend_available("webgpu"):
    pytest.skip(f"webgpu unavailable: {get_backend_info('webgpu').reason}", allow_module_level=True)

from yirage.tools.conformance import CASES, run_case  # noqa: E402

TYPES = ("q5_0", "q5_1", "q2_k", "q3_k")
NEW_CASES = [c for c in CASES if c.op in ("linear", "embedding") and any(t in c.id.lower() for t in TYPES)]


def test_cases_found():
    assert {t for t in TYPES for c in NEW_CASES if t in c.id.lower()} == set(TYPES)


@pytest.mark.parametrize("case", NEW_CASES, ids=[c.id for c in NEW_CASES])
def test_qtypes_more_on_webgpu(case):
    result = run_case(case, "webgpu")
    assert result.status == "PASS", result.message
    assert result.fallback == ()
