"""Backend registry and the contract every available backend must meet."""
from __future__ import annotations

import os
import sys

import pytest
import torch

import yirage.backends as backends
from yirage.backends import Backend, BackendInfo, MemoryInfo
from yirage.backends.base import BackendImpl
from yirage.backends.triton.cuda import CUDABackend
from yirage.errors import BackendUnavailableError

AVAILABLE = backends.get_available_backends()
#: what 'auto' picks: the first available backend it may pick (never a software WebGPU adapter)
AUTO = next(b for b in AVAILABLE if backends.get_backend_impl(b).auto_eligible())
GPU_BACKENDS = [Backend.CUDA, Backend.ROCM, Backend.XPU, Backend.MPS]
UNAVAILABLE_GPUS = [b for b in GPU_BACKENDS if b not in AVAILABLE]
ON_LINUX = sys.platform.startswith("linux")


@pytest.fixture(autouse=True)
def clean_default(monkeypatch):
    """Start from no explicit choice and no YIRAGE_BACKEND; restore the default afterwards."""
    monkeypatch.setattr(backends, "_explicit_backend", None)
    monkeypatch.delenv("YIRAGE_BACKEND", raising=False)


def _proc_field(path: str, name: str) -> str:
    with open(path) as f:
        for line in f:
            key, _, value = line.partition(":")
            if key.strip() == name:
                return value.strip()
    raise AssertionError(f"{name} not in {path}")


# --- registry -------------------------------------------------------------------------


def test_backend_values():
    assert [b.value for b in Backend] == ["cpu", "cuda", "rocm", "xpu", "mps", "webgpu", "triton-interpret"]


def test_cpu_is_available_and_listed():
    assert backends.is_backend_available("cpu")
    assert backends.is_backend_available(Backend.CPU)
    assert Backend.CPU in AVAILABLE
    assert [b for b in AVAILABLE if b != Backend.TRITON_INTERPRET][-1] == Backend.CPU


def test_unknown_name_is_not_available():
    assert backends.is_backend_available("tpu") is False


def test_names_are_case_insensitive():
    assert backends.resolve_backend(" CPU ") == Backend.CPU
    assert backends.set_backend("Cpu") == Backend.CPU


def test_auto_picks_first_available():
    assert backends.resolve_backend("auto") == AUTO
    assert backends.get_backend() == AUTO
    assert backends.get_backend_source() == "auto"


@pytest.mark.skipif(AUTO != Backend.CPU, reason="a GPU backend is available here")
def test_auto_resolves_to_cpu_without_gpus():
    assert backends.resolve_backend("auto") == Backend.CPU
    assert backends.set_backend("auto") == Backend.CPU


def test_auto_prefers_cuda_when_available(monkeypatch):
    monkeypatch.setattr(CUDABackend, "is_available", lambda self: True)
    assert backends.get_available_backends()[0] == Backend.CUDA
    assert backends.resolve_backend("auto") == Backend.CUDA
    assert backends.get_backend() == Backend.CUDA


@pytest.mark.parametrize(
    "cuda_version, hip_version, expected, other, other_reason",
    [
        ("12.4", None, Backend.CUDA, Backend.ROCM, "torch.version.hip is None"),
        (None, "6.2.41133", Backend.ROCM, Backend.CUDA, "ROCm/HIP"),
    ],
)
def test_cuda_rocm_detection_from_torch_build(
    monkeypatch, cuda_version, hip_version, expected, other, other_reason
):
    monkeypatch.setattr(torch.version, "cuda", cuda_version)
    monkeypatch.setattr(torch.version, "hip", hip_version)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert backends.is_backend_available(expected)
    assert not backends.is_backend_available(other)
    assert backends.resolve_backend("auto") == expected
    assert other_reason in backends.get_backend_info(other).reason


def test_env_sets_default(monkeypatch):
    monkeypatch.setenv("YIRAGE_BACKEND", "CPU")
    assert backends.get_backend() == Backend.CPU
    assert backends.get_backend_source() == "env"


def test_env_auto(monkeypatch):
    monkeypatch.setenv("YIRAGE_BACKEND", "auto")
    assert backends.get_backend() == AUTO
    assert backends.get_backend_source() == "env"


def test_set_backend_overrides_env(monkeypatch):
    monkeypatch.setenv("YIRAGE_BACKEND", "tpu")
    assert backends.set_backend("cpu") == Backend.CPU
    assert backends.get_backend() == Backend.CPU
    assert backends.get_backend_source() == "set_backend"


def test_bad_env_value_raises(monkeypatch):
    monkeypatch.setenv("YIRAGE_BACKEND", "tpu")
    with pytest.raises(BackendUnavailableError, match="tpu") as excinfo:
        backends.get_backend()
    assert "YIRAGE_BACKEND" in str(excinfo.value)


def test_unknown_name_raises_everywhere():
    calls = [
        backends.set_backend,
        backends.resolve_backend,
        backends.get_backend_impl,
        backends.get_backend_info,
        backends.get_memory_info,
    ]
    for call in calls:
        with pytest.raises(BackendUnavailableError) as excinfo:
            call("tpu")
        message = str(excinfo.value)
        assert "'tpu'" in message and "unknown" in message
        assert "known backends: cpu, cuda, rocm, xpu, mps" in message
        assert "Available backends:" in message and "cpu" in message.split("Available")[1]


@pytest.mark.skipif(Backend.CUDA in AVAILABLE, reason="CUDA is available here")
def test_unavailable_cuda_raises_with_reason():
    reason = CUDABackend().unavailable_reason()
    assert reason
    for call in (backends.set_backend, backends.resolve_backend,
                 backends.get_backend_impl, backends.get_memory_info):
        with pytest.raises(BackendUnavailableError) as excinfo:
            call("cuda")
        message = str(excinfo.value)
        assert message.startswith(f"backend 'cuda' is unavailable: {reason}")
        assert "cpu" in message.split("Available backends:")[1]


def test_failed_set_backend_keeps_previous_default():
    backends.set_backend("cpu")
    with pytest.raises(BackendUnavailableError):
        backends.set_backend("tpu")
    assert backends.get_backend() == Backend.CPU
    assert backends.get_backend_source() == "set_backend"


@pytest.mark.parametrize("backend", UNAVAILABLE_GPUS, ids=lambda b: b.value)
def test_unavailable_gpu_info_does_not_raise(backend):
    info = backends.get_backend_info(backend.value)
    assert info.available is False
    assert info.reason
    assert info.device_name is None and info.memory_total_bytes is None
    assert info.isa_flags == [] and info.compute_capability is None
    assert "torch" in info.versions
    impl = backends._IMPLS[backend]
    with pytest.raises(BackendUnavailableError, match=backend.value):
        impl.memory_info()
    with pytest.raises(BackendUnavailableError):
        impl.synchronize()


def test_codegen_and_torch_device():
    expected = {
        Backend.CPU: ("cpp", "cpu"),
        Backend.CUDA: ("triton", "cuda"),
        Backend.ROCM: ("triton", "cuda"),
        Backend.XPU: ("triton", "xpu"),
        Backend.MPS: (None, "mps"),
        Backend.TRITON_INTERPRET: ("triton", "cpu"),
    }
    for backend, (codegen, device_type) in expected.items():
        impl = backends._IMPLS[backend]
        assert impl.name == backend
        assert impl.codegen == codegen
        assert impl.kernel_mode == (f"compiled ({codegen})" if codegen else "torch ops")
        assert impl.torch_device == torch.device(device_type)


# --- CPU details ----------------------------------------------------------------------

EXPECTED_ISA_NAMES = {
    "avx", "avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512_vnni", "avx512_bf16", "avx_vnni", "avx_ne_convert",
    "amx_tile", "amx_bf16", "amx_int8", "neon", "asimd", "asimddp", "i8mm", "bf16", "fphp", "asimdhp", "sve", "sve2",
}
#: the flags of EXPECTED_ISA_NAMES each x86-64 psABI level (YIRAGE_ISA) keeps
LEVEL_ISA_NAMES = {"avx2": {"avx", "avx2", "fma", "f16c"}, "x86-64-v3": {"avx", "avx2", "fma", "f16c"},
                   "x86-64-v2": set()}


def test_cpu_info_basics():
    info = backends.get_backend_info("cpu")
    assert isinstance(info, BackendInfo)
    assert info.available and info.reason is None
    assert info.device_name
    assert info.compute_units > 0
    assert info.memory_total_bytes > 0
    assert info.compute_capability is None
    assert info.versions["torch"] == torch.__version__
    assert info.to_dict()["name"] == "cpu"


@pytest.mark.skipif(not ON_LINUX, reason="reads /proc/cpuinfo")
def test_cpu_isa_flags_match_proc_cpuinfo():
    try:
        reported = _proc_field("/proc/cpuinfo", "flags")
    except AssertionError:
        reported = _proc_field("/proc/cpuinfo", "Features")
    expected = set(reported.split()) & EXPECTED_ISA_NAMES
    cap = os.environ.get("YIRAGE_ISA", "native")
    if cap != "native":
        expected &= LEVEL_ISA_NAMES[cap]
    assert set(backends.get_backend_info("cpu").isa_flags) == expected


@pytest.mark.skipif(not ON_LINUX, reason="reads /proc/meminfo")
def test_cpu_memory_matches_proc_meminfo():
    total_kib = int(_proc_field("/proc/meminfo", "MemTotal").split()[0])
    memory = backends.get_memory_info("cpu")
    assert isinstance(memory, MemoryInfo)
    assert memory.total_bytes == total_kib * 1024
    assert 0 < memory.free_bytes <= memory.total_bytes
    assert memory.used_bytes == memory.total_bytes - memory.free_bytes
    assert backends.get_backend_info("cpu").memory_total_bytes == memory.total_bytes


# --- the contract, on every backend available here -------------------------------------


@pytest.mark.parametrize("backend", AVAILABLE, ids=lambda b: b.value)
def test_available_backend_contract(backend):
    impl = backends.get_backend_impl(backend)
    assert isinstance(impl, BackendImpl)
    assert impl.is_available() and impl.unavailable_reason() is None
    info = impl.info()
    assert info.available and info.name == backend
    assert info.device_name
    assert info.memory_total_bytes and info.memory_total_bytes > 0
    memory = impl.memory_info()
    assert memory.total_bytes > 0
    x = torch.ones(4, device=impl.torch_device)
    y = (x * 2).sum()
    impl.synchronize()
    assert y.item() == 8.0


# --- Triton's interpreter as a backend -------------------------------------------------


def _available_in_child(env_value):
    import os
    import subprocess
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    if env_value is not None:
        env["TRITON_INTERPRET"] = env_value
    code = ("import yirage as yr\n"
            "print([b.value for b in yr.get_available_backends()], yr.get_backend().value)\n"
            "print(yr.get_backend_info('triton-interpret').reason)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    assert out.returncode == 0, out.stderr
    return out.stdout.splitlines()


@pytest.mark.skipif(any(b not in ("cpu", "triton-interpret") for b in AVAILABLE), reason="a GPU backend is available here")
def test_triton_interpreter_needs_the_env_and_is_never_auto():
    listed, reason = _available_in_child(None)
    assert listed == "['cpu'] cpu" and "TRITON_INTERPRET=1" in reason
    listed, reason = _available_in_child("1")
    assert listed == "['cpu', 'triton-interpret'] cpu" and reason == "None"
