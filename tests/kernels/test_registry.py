"""The native-kernel registry: which variant each CPU gets, why, and that the chosen one builds."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

from genfast import kernels
from genfast.platform import hardware
from tests.cpus import OLD_X86, SKYLAKE_X, ZEN3, ZEN4, pretend_cpu

ROOT = Path(__file__).resolve().parents[2]


def chosen(kernel: kernels.Kernel) -> str | None:
    variant, _ = kernel.choose()
    return variant.isa if variant else None


AVX2 = {
    name: "avx2"
    for name in (
        "qlinear",
        "linear_few_rows",
        "linear_widening_gemm",
        "rel_pos_attention",
        "group_norm",
        "decode_attention",
    )
}
NONE = dict.fromkeys(AVX2)


@pytest.mark.parametrize(
    "flags,cap,expected",
    [
        # The widening GEMM has only an AVX2 variant (it serves fp32 compute, i.e. no native bf16).
        (ZEN4, None, {**dict.fromkeys(AVX2, "avx512"), "linear_widening_gemm": "avx2"}),
        (ZEN4, "avx2", AVX2),
        (ZEN4, "none", NONE),
        # AVX-512 without VNNI or BF16: the AVX2 kernels but the plain AVX-512 GroupNorm and attention.
        (SKYLAKE_X, None, {**AVX2, "group_norm": "avx512", "decode_attention": "avx512"}),
        (ZEN3, None, AVX2),
        (OLD_X86, None, NONE),
    ],
)
def test_variant_choice_per_cpu(monkeypatch, flags, cap, expected):
    pretend_cpu(monkeypatch, flags, cap)
    monkeypatch.delenv(kernels.DISABLE_ENV, raising=False)
    assert {k.name: chosen(k) for k in kernels.KERNELS} == expected


def test_reasons_name_what_is_missing(monkeypatch):
    pretend_cpu(monkeypatch, ZEN4, "avx2")
    monkeypatch.delenv(kernels.DISABLE_ENV, raising=False)
    variant, why = kernels.QLINEAR.choose()
    assert variant.isa == "avx2" and "not allowed by GENFAST_ISA=avx2" in why
    pretend_cpu(monkeypatch, ZEN3)
    assert "this CPU lacks avx512f" in kernels.GROUP_NORM.choose()[1]
    monkeypatch.setenv(kernels.DISABLE_ENV, "0")
    assert kernels.QLINEAR.choose() == (None, "disabled by GENFAST_NATIVE_KERNELS=0")
    assert kernels.QLINEAR.unavailable_reason() == "disabled by GENFAST_NATIVE_KERNELS=0"
    setting = "-group_norm,-decode_attention"
    monkeypatch.setenv(kernels.DISABLE_ENV, setting)
    assert kernels.DECODE_ATTENTION.choose() == (None, f"disabled by GENFAST_NATIVE_KERNELS={setting}")
    assert kernels.QLINEAR.choose()[0].isa == "avx2"  # the kernels not named keep their variant


def test_every_variant_has_its_source_and_matching_compiler_flags():
    needs = {
        "avx512f": "-mavx512f",
        "avx512bw": "-mavx512bw",
        "avx512vl": "-mavx512vl",
        "avx512_vnni": "-mavx512vnni",
        "avx512_bf16": "-mavx512bf16",
        "avx2": "-mavx2",
        "fma": "-mfma",
        "f16c": "-mf16c",
    }
    for kernel in kernels.KERNELS:
        for variant in kernel.variants:
            assert variant.path.is_file(), variant
            assert variant.source == f"{kernel.name}_{variant.isa}.cpp"
            assert variant.isa in hardware.ISA_LEVELS
            for flag in variant.cpu_flags:
                assert needs[flag] in variant.cflags, (variant, flag)
    assert set(kernels.SOURCE_DIR.glob("*.cpp")) == {v.path for k in kernels.KERNELS for v in k.variants}


def test_a_missing_source_is_a_reason_not_an_error():
    ghost = kernels.Kernel("ghost", "test kernel", (kernels.Variant("none", "../../ghost_none.cpp", (), ()),))
    assert ghost.unavailable_reason().startswith("its source is missing")


def test_a_build_that_was_killed_does_not_leave_later_starts_waiting(tmp_path, monkeypatch):
    """cpp_extension marks a build in progress with a `lock` file in its folder and waits, with no
    limit, while one exists: a build killed half-way (Ctrl-C on the first use) left one behind,
    and every later start hung at "building the native ..." (found when `genfast info` waited 5
    minutes on this machine)."""
    from torch.utils import cpp_extension

    monkeypatch.setenv("GENFAST_KERNEL_DIR", str(tmp_path))
    monkeypatch.setattr(kernels, "_LOADED", {})
    kernel = kernels.KERNELS[0]
    variant = kernel.variants[-1]
    folder = tmp_path / kernels.build_name(kernel.name, variant)
    folder.mkdir()
    (folder / "lock").touch()  # what the killed build left

    def load(build_directory: str, **kwargs) -> None:
        if (Path(build_directory) / "lock").exists():
            pytest.fail("cpp_extension would wait for this lock forever")

    monkeypatch.setattr(cpp_extension, "load", load)
    assert kernels._build.__wrapped__(kernel.name, variant, kernel.what) is None
    assert kernels._LOADED[kernel.name] == variant.isa


def test_a_kernel_folder_genfast_cannot_write_is_a_reason_not_an_error(tmp_path, monkeypatch):
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    monkeypatch.setenv("GENFAST_KERNEL_DIR", str(blocker / "kernels"))
    kernel = kernels.KERNELS[0]
    why = kernels._build.__wrapped__(kernel.name, kernel.variants[-1], kernel.what)
    assert why is not None and why.startswith(f"cannot write {blocker / 'kernels'}") and "GENFAST_KERNEL_DIR" in why


@pytest.mark.parametrize("kernel", kernels.KERNELS, ids=lambda k: k.name)
def test_the_chosen_variant_builds_where_the_cpu_supports_it(kernel):
    """Where the CPU has a variant's instructions, a failed build is a bug, not a silent slow path."""
    variant, why = kernel.choose()
    if variant is None:
        pytest.skip(why)
    assert kernel.unavailable_reason() is None
    assert kernel.loaded_isa() == variant.isa


def test_a_process_keeps_the_variant_it_loaded(monkeypatch):
    """Its ops are registered once per process: a test that pretends another CPU afterwards must
    neither build a second variant nor be told the other one runs (genfast.quant.packing.
    dynamic_activation_max follows the variant in use)."""
    if not kernels.QLINEAR.available():
        pytest.skip(kernels.QLINEAR.unavailable_reason())
    loaded = kernels.QLINEAR.loaded_isa()
    pretend_cpu(monkeypatch, ZEN3 if loaded == "avx512" else ZEN4)
    assert chosen(kernels.QLINEAR) != loaded

    def build(*args):
        raise AssertionError("a second variant was built")

    monkeypatch.setattr(kernels, "_build", build)
    assert kernels.QLINEAR.available() and kernels.QLINEAR.loaded_isa() == loaded


LOWER_LEVELS = hardware.ISA_LEVELS[hardware.ISA_LEVELS.index(hardware.isa()) + 1 :]
# The kernels' own tests: each variant against its reference and the portable path; and oneDNN's
# int8 convolution, whose AVX2 code saturates where its VNNI code does not.
VARIANT_TESTS = [
    "tests/quant/test_linear.py",
    "tests/quant/test_conv.py",
    "tests/test_nn.py",
    "tests/sam/test_attention.py",
    "tests/diffusion/test_group_norm.py",
    "tests/llm/model/test_decode_attention.py",
]


@pytest.mark.parametrize("level", LOWER_LEVELS)
def test_lower_isa_variants_pass_the_kernel_tests(level):
    """With GENFAST_ISA, this machine also tests the variants of every lower ISA level (an AVX-512
    machine runs the AVX2 kernels; every machine the portable paths), with PyTorch's own kernels
    capped to the same level."""
    # Inductor's keys ignore the ISA cap: without this process's cache folder, the tests' conftest
    # gives the capped run one of its own (hardware.code_target), kept between runs as this one's is.
    env = {**os.environ, **hardware.torch_isa_env(level)}
    env.pop("TORCHINDUCTOR_CACHE_DIR", None)
    probe = subprocess.run(
        [sys.executable, "-c", "from genfast.kernels import QLINEAR; print(QLINEAR.loaded_isa())"],
        env=env,
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=True,
    )
    assert probe.stdout.split()[-1] == ("None" if level == "none" else level)  # qlinear has every level but none
    run = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-x", *VARIANT_TESTS],
        env=env,
        cwd=ROOT,
        capture_output=True,
        text=True,
    )
    assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-2000:]


def test_saved_compiled_code_depends_on_the_kernel_sources(tmp_path, monkeypatch):
    # A packed weight layout lives in a kernel's source and in genfast/quant/packing.py together:
    # code compiled against one build must not be loaded beside another.
    from genfast.compilation import artifacts

    pretend_cpu(monkeypatch, ZEN3)
    monkeypatch.delenv(kernels.DISABLE_ENV, raising=False)
    for source in kernels.SOURCE_DIR.iterdir():
        if source.suffix in (".cpp", ".h"):
            (tmp_path / source.name).write_bytes(source.read_bytes())
    monkeypatch.setattr(kernels, "SOURCE_DIR", tmp_path)
    before = artifacts.environment()["kernels"]
    assert before["qlinear"].startswith("genfast_qlinear_avx2_")
    with open(tmp_path / "qlinear.h", "a") as header:
        header.write("// changed\n")
    after = artifacts.environment()["kernels"]
    assert (
        after["qlinear"] != before["qlinear"] and after["group_norm"] != before["group_norm"]
    )  # every build reads the headers
    (tmp_path / "qlinear_avx2.cpp").unlink()
    assert artifacts.environment()["kernels"]["qlinear"] is None  # no source: nothing to build, nothing saved against
