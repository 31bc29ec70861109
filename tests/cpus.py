"""CPU flag sets of the machines genfast is tested for, and a way to pretend to be one."""

import pytest

from genfast.platform import hardware

ZEN4 = frozenset(["avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512_vnni", "avx512_bf16"])
ZEN3 = frozenset(["avx2", "fma", "f16c"])
OLD_X86 = frozenset(["sse4_2", "avx"])
SKYLAKE_X = frozenset(
    ["avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vl", "avx512dq"]
)  # AVX-512 without VNNI/BF16
XEON_WITHOUT_AMX = ZEN4 | {"avx512_fp16", "avx_vnni"}  # a Sapphire Rapids-class Xeon whose hypervisor hides AMX
XEON_WITH_AMX = XEON_WITHOUT_AMX | {"amx_tile", "amx_bf16", "amx_int8"}  # the same Xeon where AMX is shown


def pretend_cpu(
    monkeypatch: pytest.MonkeyPatch, flags: frozenset[str], isa_cap: str | None = None, vendor: str = "AuthenticAMD"
) -> None:
    """Make genfast.platform.hardware see `flags` from `vendor` (and GENFAST_ISA=isa_cap, or none)
    for this test."""
    monkeypatch.setattr(hardware, "cpu_flags", lambda: flags)
    monkeypatch.setattr(hardware, "cpu_vendor", lambda: vendor)
    if isa_cap:
        monkeypatch.setenv(hardware.ISA_ENV, isa_cap)
    else:
        monkeypatch.delenv(hardware.ISA_ENV, raising=False)
