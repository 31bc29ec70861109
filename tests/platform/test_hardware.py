"""genfast.platform.hardware: the ISA level (and its GENFAST_ISA cap), what `auto` dtype means per ISA, devices."""

import platform
from pathlib import Path

import pytest
import torch

from genfast.errors import UserError
from genfast.platform import hardware
from tests.cpus import OLD_X86, SKYLAKE_X, XEON_WITH_AMX, XEON_WITHOUT_AMX, ZEN3, ZEN4, pretend_cpu


@pytest.mark.parametrize(
    "flags,level",
    [
        (XEON_WITH_AMX, "amx"),
        (XEON_WITHOUT_AMX, "avx512"),
        (ZEN4, "avx512"),
        (SKYLAKE_X, "avx512"),
        (ZEN3, "avx2"),
        (OLD_X86, "none"),
        (frozenset(), "none"),
    ],
)
def test_detected_level(monkeypatch, flags, level):
    pretend_cpu(monkeypatch, flags)
    assert hardware.detected_isa() == level == hardware.isa()


def test_the_override_only_lowers_the_level(monkeypatch):
    pretend_cpu(monkeypatch, ZEN4)
    for cap in ("avx2", "none", "avx512"):
        monkeypatch.setenv(hardware.ISA_ENV, cap)
        assert hardware.isa() == cap
    pretend_cpu(monkeypatch, ZEN3, "avx512")
    assert hardware.isa() == "avx2"  # never above what the CPU has
    assert "detected avx2" in hardware.describe_isa()
    monkeypatch.setenv(hardware.ISA_ENV, "AVX2 ")
    assert hardware.isa() == "avx2"


def test_an_unknown_override_is_a_user_error(monkeypatch):
    pretend_cpu(monkeypatch, ZEN4, "sse9")
    with pytest.raises(UserError, match="amx, avx512, avx2, sve, neon, none"):
        hardware.isa()


def test_the_levels_form_a_tree_with_the_portable_path_at_its_root():
    """ "The levels below" a level are its path to the root, on x86 and on ARM alike."""
    assert hardware.lower_levels("amx") == ("avx512", "avx2", "none")
    assert hardware.lower_levels("avx512") == ("avx2", "none")
    assert hardware.lower_levels("sve") == ("neon", "none")
    assert hardware.lower_levels("neon") == ("none",) and hardware.lower_levels("none") == ()
    assert [level for level in hardware.ISA_LEVELS if hardware.ISA_TREE[level].below is None] == ["none"]
    assert hardware.level_cpu_flags("avx512") == ("avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vl")
    assert hardware.level_cpu_flags("sve") == ("asimd", "sve")
    assert hardware.level_cpu_flags("amx")[-1] == "amx_tile" and hardware.level_cflags("amx")[-1] == "-mamx-tile"


GRAVITON3 = frozenset(["fp", "asimd", "asimdhp", "sve", "bf16"])  # /proc/cpuinfo "Features" of an ARM server
RASPBERRY_PI_4 = frozenset(["fp", "asimd", "evtstrm", "crc32"])


def test_an_arm_cpu_gets_the_arm_levels_and_x86_caps_leave_it_portable(monkeypatch):
    pretend_cpu(monkeypatch, GRAVITON3)
    assert hardware.detected_isa() == "sve" and hardware.isa_allows("neon") and not hardware.isa_allows("avx2")
    pretend_cpu(monkeypatch, RASPBERRY_PI_4)
    assert hardware.isa() == "neon"
    pretend_cpu(monkeypatch, GRAVITON3, "neon")
    assert hardware.isa() == "neon"
    pretend_cpu(monkeypatch, GRAVITON3, "avx2")  # another branch: only the root is shared
    assert hardware.isa() == "none"
    pretend_cpu(monkeypatch, ZEN4, "sve")
    assert hardware.isa() == "none"


ALDER_LAKE = ZEN3 | {"avx_vnni"}  # AVX-VNNI without AVX-512


@pytest.mark.parametrize(
    "flags,cap,vnni",
    [
        (ZEN4, None, True),
        (ALDER_LAKE, None, True),
        (ZEN3, None, False),
        (SKYLAKE_X, None, False),
        (ZEN4, "avx2", False),
    ],
)
def test_vnni_per_cpu_and_under_a_cap(monkeypatch, flags, cap, vnni):
    """int32 sums of u8 x s8 pairs (the int8 convolution's full 8-bit activations) where the CPU has
    VNNI; a cap below AVX-512 stands for a CPU without it, as `torch_isa_env` makes oneDNN."""
    pretend_cpu(monkeypatch, flags, cap)
    assert hardware.has_vnni() == vnni


def test_torch_isa_env():
    assert hardware.torch_isa_env("avx2") == {
        "GENFAST_ISA": "avx2",
        "ATEN_CPU_CAPABILITY": "avx2",
        "ONEDNN_MAX_CPU_ISA": "AVX2",
        "MKL_ENABLE_INSTRUCTIONS": "AVX2",
    }
    assert hardware.torch_isa_env("none") == {"GENFAST_ISA": "none"}
    with pytest.raises(UserError, match="not an ISA level"):
        hardware.torch_isa_env("sse9")


def test_compiled_code_is_kept_apart_per_cpu_and_cap(monkeypatch):
    """Inductor's cache keys ignore the CPU: genfast keeps its caches apart by `code_target`."""
    for var in hardware.TORCH_ISA_ENV["avx2"]:
        monkeypatch.delenv(var, raising=False)
    pretend_cpu(monkeypatch, ZEN4)
    zen4 = hardware.code_target()
    assert zen4.startswith("avx512-") and zen4 == hardware.code_target()
    pretend_cpu(monkeypatch, ZEN4 | {"md_clear", "hypervisor"})  # flags that do not change code
    assert hardware.code_target() == zen4
    pretend_cpu(monkeypatch, ZEN4 | {"amx_tile"})
    assert hardware.code_target() != zen4
    pretend_cpu(monkeypatch, ZEN4, vendor="GenuineIntel")  # the same flags, other bf16 products
    assert hardware.code_target() != zen4
    pretend_cpu(monkeypatch, ZEN3)
    assert hardware.code_target().startswith("avx2-")
    pretend_cpu(monkeypatch, ZEN4)
    monkeypatch.setenv("ATEN_CPU_CAPABILITY", "avx2")
    assert hardware.code_target() != zen4


@pytest.mark.parametrize(
    "flags,cap,expected",
    [
        (ZEN4, None, torch.bfloat16),  # native bf16 dot products: bf16 reads half the bytes
        (ZEN4, "avx2", torch.float32),  # the AVX2 paths have no native bf16
        (ZEN3, None, torch.float32),  # emulated bf16: fp32 is several times faster
        (SKYLAKE_X, None, torch.float32),
        (OLD_X86, None, torch.float32),
    ],
)
def test_auto_dtype_per_isa(monkeypatch, flags, cap, expected):
    pretend_cpu(monkeypatch, flags, cap)
    assert hardware.auto_dtype(torch.device("cpu")) == expected
    assert hardware.resolve_dtype("auto", torch.device("cpu")) == expected
    assert hardware.auto_dtype(torch.device("cuda")) == torch.bfloat16


@pytest.mark.parametrize(
    "flags,vendor,cap,fast,fast_dot,amx",
    [
        (ZEN4, "AuthenticAMD", None, True, True, False),  # one vdpbf16ps does twice an fp32 FMA's multiply-adds
        (XEON_WITHOUT_AMX, "GenuineIntel", None, False, False, False),  # vdpbf16ps issues at a quarter of FMA's rate
        (XEON_WITH_AMX, "GenuineIntel", None, True, False, True),  # oneDNN's AMX tiles; vdpbf16ps as slow
        (XEON_WITH_AMX, "GenuineIntel", "avx2", False, False, False),  # a cap stands for a CPU without either
        (ZEN4, "AuthenticAMD", "avx2", False, False, False),
        (ZEN3, "AuthenticAMD", None, False, False, False),
    ],
)
def test_fast_bf16_products_per_cpu(monkeypatch, flags, vendor, cap, fast, fast_dot, amx):
    """Where bf16 instructions exist but are slower than fp32 FMAs, `--dtype auto` still keeps bf16
    tensors (half the bytes); only the products that know the difference compute in fp32. PyTorch's
    products (oneDNN: AMX's tiles where there are) and genfast's kernels' (vdpbf16ps) differ on an
    Intel CPU with AMX."""
    pretend_cpu(monkeypatch, flags, cap, vendor)
    assert hardware.fast_bf16_products() == fast
    assert hardware.fast_bf16_dot_products() == fast_dot
    assert hardware.has_amx_bf16() == amx
    assert hardware.auto_dtype(torch.device("cpu")) == (torch.float32 if cap or flags == ZEN3 else torch.bfloat16)


@pytest.mark.parametrize("flags, auto", [(ZEN4, torch.bfloat16), (ZEN3, None)])
def test_the_recipes_bf16_step_follows_the_cpu(monkeypatch, flags, auto):
    """--dtype auto of `bench sam`, `bench diffusion` and `imagine`: the bf16 step where the CPU
    computes in bf16 natively, fp32 throughout (None) where it emulates it."""
    pretend_cpu(monkeypatch, flags)
    cpu = torch.device("cpu")
    assert hardware.low_precision_dtype("auto", cpu) == auto
    assert hardware.low_precision_dtype("bfloat16", cpu) == torch.bfloat16
    assert hardware.low_precision_dtype("float32", cpu) is None
    with pytest.raises(UserError, match="float16 is slow"):  # float16: CUDA only
        hardware.low_precision_dtype("float16", cpu)
    with pytest.raises(UserError, match="unknown dtype"):
        hardware.low_precision_dtype("int3", cpu)
    assert hardware.low_precision_note(cpu).startswith("this CPU has no native bf16" if auto is None else "--dtype")


def test_dtype_and_device_errors():
    with pytest.raises(UserError, match="unknown dtype"):
        hardware.resolve_dtype("int3", torch.device("cpu"))
    with pytest.raises(UserError, match="float16 is slow"):
        hardware.resolve_dtype("fp16", torch.device("cpu"))
    assert hardware.resolve_dtype("auto", torch.device("cpu"), auto=torch.float64) == torch.float64
    with pytest.raises(UserError, match="unknown device"):
        hardware.resolve_device("gpu7")
    with pytest.raises(UserError, match="not supported"):
        hardware.resolve_device("meta")
    if not torch.cuda.is_available():
        with pytest.raises(UserError, match="no CUDA GPU"):
            hardware.resolve_device("cuda")
        assert hardware.resolve_device("auto") == torch.device("cpu")


def test_a_cuda_index_is_checked_and_becomes_the_current_device(monkeypatch):
    """genfast's Triton kernels launch on the current device: --device cuda:1 must make it so."""
    current = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(torch.cuda, "set_device", current.append)
    assert hardware.resolve_device("cuda:1") == torch.device("cuda", 1) and current == [torch.device("cuda", 1)]
    assert hardware.resolve_device("cuda") == torch.device("cuda") and len(current) == 1
    with pytest.raises(UserError, match=r"--device cuda:2: torch sees 2 CUDA GPU\(s\), cuda:0 to cuda:1"):
        hardware.resolve_device("cuda:2")


def test_real_cpu_is_described():
    assert hardware.isa() in hardware.ISA_LEVELS
    assert hardware.cpu_vendor() or platform.machine() != "x86_64" or not Path("/proc/cpuinfo").exists()
    assert hardware.describe_isa().startswith(hardware.isa())
    assert hardware.peak_memory_bytes("cpu") > 0
    hardware.synchronize("cpu")
