"""CPU flag sets of the machines genfast is tested for, and a way to pretend to be one."""

import pytest

from genfast.platform import hardware

ZEN4 = frozenset(["avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512_vnni", "avx512_bf16"])
ZEN3 = frozenset(["avx2", "fma", "f16c"])
OLD_X86 = frozenset(["sse4_2", "avx"])
SKYLAKE_X = frozenset(
    ["avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vl", "avx512dq"]
)  # AVX-512 without VNNI/BF16


def pretend_cpu(monkeypatch: pytest.MonkeyPatch, flags: frozenset[str], isa_cap: str | None = None) -> None:
    """Make genfast.platform.hardware see `flags` (and GENFAST_ISA=isa_cap, or none) for this test."""
    monkeypatch.setattr(hardware, "cpu_flags", lambda: flags)
    if isa_cap:
        monkeypatch.setenv(hardware.ISA_ENV, isa_cap)
    else:
        monkeypatch.delenv(hardware.ISA_ENV, raising=False)
