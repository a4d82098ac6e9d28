"""CPU-runnable checks of the CUDA backend: the extension (when built) imports, exposes its
handler capsules and attaches to _tpusync's engine registry, and registration is a no-op
without a GPU. These run in CI, which builds the extension but has no GPU."""

from __future__ import annotations

import types

import pytest

from jax_tpusync import _tpusync
from jax_tpusync.runtime import _cuda

_TARGETS = {
    "tpusync_start",
    "tpusync_wait",
    "tpusync_write_back",
    "tpusync_mark",
    "tpusync_pointer_kind",
}


@pytest.fixture
def ext():
    module = _cuda.extension()
    if module is None:
        pytest.skip("jax_tpusync was built without CUDA support (no CUDA toolkit at build time)")
    return module


def _is_capsule(obj) -> bool:
    return type(obj).__name__ == "PyCapsule"


def test_registry_capsule_is_exported():
    capsule = _tpusync.engine_registry_capsule()
    assert _is_capsule(capsule)


def test_registrations_are_capsules(ext):
    regs = ext.registrations()
    assert set(regs) == _TARGETS
    assert all(_is_capsule(c) for c in regs.values())


def test_attach_accepts_registry_and_rejects_other_capsules(ext):
    with pytest.raises(ValueError, match="tpusync: expected a 'tpusync.EngineRegistry'"):
        ext.attach(ext.registrations()["tpusync_start"])
    ext.attach(_tpusync.engine_registry_capsule())
    ext.attach(_tpusync.engine_registry_capsule())  # Idempotent.
    assert ext.attached()


def test_introspection_without_a_gpu(ext):
    assert ext.cuda_runtime_version() >= 12080
    assert ext.device_count() >= 0  # 0 here: no driver is not an error.
    assert ext.async_error() is None
    stats = ext.stats()
    assert stats["fetches"] == 0 and stats["prefetch_hits"] == 0


def test_benchmarks_fail_cleanly_without_a_gpu(ext):
    if ext.device_count() > 0:
        pytest.skip("a GPU is present (covered by test_cuda_gpu.py)")
    with pytest.raises(RuntimeError, match="^tpusync: CUDA"):
        ext.memcpy_h2d_gbps([1 << 20], iters=1)


def test_register_is_a_noop_without_a_gpu(monkeypatch):
    if _cuda.gpu_present():
        pytest.skip("a CUDA GPU is present")
    assert _cuda.register() is False
    assert not _cuda.registered()


def test_register_without_extension_on_gpu_is_an_error(monkeypatch):
    monkeypatch.setattr(_cuda, "_registered", None)
    monkeypatch.setattr(_cuda, "gpu_present", lambda: True)
    monkeypatch.setattr(_cuda, "extension", lambda: None)
    with pytest.raises(RuntimeError, match="built without CUDA support"):
        _cuda.register()


def test_register_registers_every_target_for_cuda(monkeypatch, ext):
    calls = []
    monkeypatch.setattr(_cuda, "_registered", None)
    monkeypatch.setattr(_cuda, "gpu_present", lambda: True)
    monkeypatch.setattr(
        _cuda.jax,
        "ffi",
        types.SimpleNamespace(
            register_ffi_target=lambda name, capsule, platform: calls.append((name, platform))
        ),
    )
    assert _cuda.register() is True
    assert sorted(calls) == sorted((name, "CUDA") for name in _TARGETS)
    assert ext.attached()
