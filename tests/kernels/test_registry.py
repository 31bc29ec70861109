"""The native-kernel registry: which variant each CPU gets, why, that the chosen one builds, and that
a kernel is one folder (its variants, headers and op schemas together)."""

import ast
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

import genfast
from genfast.kernels import native, registry
from genfast.kernels.qlinear import ops as qlinear
from genfast.platform import hardware
from tests.cpus import OLD_X86, SKYLAKE_X, XEON_WITH_AMX, ZEN3, ZEN4, pretend_cpu

ROOT = Path(__file__).resolve().parents[2]
QLINEAR = qlinear.KERNEL


def by_name(name: str) -> native.Kernel:
    return registry.by_name(name)


def chosen(kernel: native.Kernel) -> str | None:
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
        "mxfp4_linear",
        "upsampled_masks",
    )
}
NONE = dict.fromkeys(AVX2)


@pytest.mark.parametrize(
    "flags,cap,expected",
    [
        # The widening GEMM has only an AVX2 variant (it serves fp32 compute, i.e. no native bf16).
        (ZEN4, None, {**dict.fromkeys(AVX2, "avx512"), "linear_widening_gemm": "avx2"}),
        # AMX's tiles: the int8 linear's dynamic products and the attention's bf16 products; the
        # rest as on any AVX-512 CPU, also capped to AVX-512.
        (
            XEON_WITH_AMX,
            None,
            {
                **dict.fromkeys(AVX2, "avx512"),
                "linear_widening_gemm": "avx2",
                "qlinear": "amx",
                "rel_pos_attention": "amx",
            },
        ),
        (XEON_WITH_AMX, "avx512", {**dict.fromkeys(AVX2, "avx512"), "linear_widening_gemm": "avx2"}),
        (ZEN4, "avx2", AVX2),
        (ZEN4, "none", NONE),
        # AVX-512 without VNNI or BF16: the AVX2 kernels but the plain AVX-512 ones (GroupNorm,
        # decode attention, upsampled masks).
        (SKYLAKE_X, None, {**AVX2, **dict.fromkeys(("group_norm", "decode_attention", "upsampled_masks"), "avx512")}),
        (ZEN3, None, AVX2),
        (OLD_X86, None, NONE),
    ],
)
def test_variant_choice_per_cpu(monkeypatch, flags, cap, expected):
    pretend_cpu(monkeypatch, flags, cap)
    monkeypatch.delenv(native.DISABLE_ENV, raising=False)
    assert {k.name: chosen(k) for k in registry.KERNELS} == expected


def test_reasons_name_what_is_missing(monkeypatch):
    pretend_cpu(monkeypatch, ZEN4, "avx2")
    monkeypatch.delenv(native.DISABLE_ENV, raising=False)
    variant, why = QLINEAR.choose()
    assert variant.isa == "avx2" and "not allowed by GENFAST_ISA=avx2" in why
    pretend_cpu(monkeypatch, ZEN3)
    assert "this CPU lacks avx512f" in by_name("group_norm").choose()[1]
    monkeypatch.setenv(native.DISABLE_ENV, "0")
    assert QLINEAR.choose() == (None, "disabled by GENFAST_NATIVE_KERNELS=0")
    assert QLINEAR.unavailable_reason() == "disabled by GENFAST_NATIVE_KERNELS=0"
    setting = "-group_norm,-decode_attention"
    monkeypatch.setenv(native.DISABLE_ENV, setting)
    assert by_name("decode_attention").choose() == (None, f"disabled by GENFAST_NATIVE_KERNELS={setting}")
    assert QLINEAR.choose()[0].isa == "avx2"  # the kernels not named keep their variant


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
        "amx_tile": "-mamx-tile",
        "amx_int8": "-mamx-int8",
        "amx_bf16": "-mamx-bf16",
    }
    for kernel in registry.KERNELS:
        for variant in kernel.variants:
            assert kernel.source(variant).is_file(), variant
            assert variant.isa in hardware.ISA_TREE and variant.isa != "none"
            for flag in variant.cpu_flags:
                assert needs[flag] in variant.cflags, (variant, flag)


def test_a_missing_source_is_a_reason_not_an_error():
    ghost = native.Kernel("ghost", "test kernel", (native.Variant("avx2"),), rank=99)
    assert ghost.unavailable_reason().startswith("its source is missing")


def _ops_defined(path: Path) -> set[str]:
    """The genfast ops whose schema a module defines (torch.library.define, triton_op, custom_op)."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Call) and node.args and isinstance(node.args[0], ast.Constant):
            op, call = str(node.args[0].value), ast.unparse(node.func)
            if op.startswith("genfast::") and call.endswith(("library.define", "triton_op", "custom_op")):
                names.add(op.removeprefix("genfast::"))
    return names


def test_a_kernel_is_one_folder_with_its_ops_beside_its_sources():
    """Each folder with C++ is a kernel: a source per variant, named after its ISA level, and an
    ops.py that declares the Kernel and defines the schema of every op its sources implement."""
    folders = {p.parent for p in native.SOURCE_DIR.glob("*/*.cpp")}
    assert folders == {k.folder for k in registry.KERNELS}
    assert native.SOURCE_DIR / native.COMMON not in folders  # shared headers only
    for kernel in registry.KERNELS:
        assert set(kernel.folder.glob("*.cpp")) == {kernel.source(v) for v in kernel.variants}, kernel.name
        implemented = set()
        for source in kernel.folder.glob("*.cpp"):
            implemented |= set(re.findall(r'm\.impl\("(\w+)"', source.read_text()))
        assert implemented and implemented == _ops_defined(kernel.folder / "ops.py"), kernel.name
    ranks = [k.rank for k in registry.KERNELS]
    assert len(set(ranks)) == len(ranks)


def test_per_variant_facts_name_every_variant():
    from genfast.kernels.rel_pos_attention import ops as rel_pos_attention

    for facts, kernel in (
        (qlinear.DYNAMIC_ACTIVATION_MAX, qlinear.KERNEL),
        (rel_pos_attention.DTYPES, rel_pos_attention.KERNEL),
    ):
        assert set(facts) == {v.isa for v in kernel.variants}, kernel.name


def test_op_schemas_are_defined_only_in_genfast_kernels():
    """The native ops' schemas and fake implementations live beside their kernels; elsewhere only
    custom_op composites, ops implemented in Python by the code that defines them."""
    package = Path(genfast.__file__).parent
    kernels_dir = package / "kernels"
    schema = re.compile(r"torch\.library\.(define|register_fake|impl|Library|triton_op)\b|\bTORCH_LIBRARY\b")
    outside = [
        str(path.relative_to(package))
        for path in package.rglob("*")
        if path.suffix in (".py", ".cpp", ".h") and kernels_dir not in path.parents and schema.search(path.read_text())
    ]
    assert not outside, outside


def test_a_build_that_was_killed_does_not_leave_later_starts_waiting(tmp_path, monkeypatch):
    """cpp_extension marks a build in progress with a `lock` file in its folder and waits, with no
    limit, while one exists: a build killed half-way (Ctrl-C on the first use) left one behind,
    and every later start hung at "building the native ..." (found when `genfast info` waited 5
    minutes on this machine)."""
    from torch.utils import cpp_extension

    monkeypatch.setenv("GENFAST_KERNEL_DIR", str(tmp_path))
    monkeypatch.setattr(native, "_LOADED", {})
    kernel = registry.KERNELS[0]
    variant = kernel.variants[-1]
    folder = tmp_path / native.build_name(kernel, variant)
    folder.mkdir()
    (folder / "lock").touch()  # what the killed build left

    def load(build_directory: str, **kwargs) -> None:
        if (Path(build_directory) / "lock").exists():
            pytest.fail("cpp_extension would wait for this lock forever")

    monkeypatch.setattr(cpp_extension, "load", load)
    assert native._build.__wrapped__(kernel, variant) is None
    assert native._LOADED[kernel.name] == variant.isa


def test_a_kernel_folder_genfast_cannot_write_is_a_reason_not_an_error(tmp_path, monkeypatch):
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    monkeypatch.setenv("GENFAST_KERNEL_DIR", str(blocker / "kernels"))
    kernel = registry.KERNELS[0]
    why = native._build.__wrapped__(kernel, kernel.variants[-1])
    assert why is not None and why.startswith(f"cannot write {blocker / 'kernels'}") and "GENFAST_KERNEL_DIR" in why


@pytest.mark.parametrize("kernel", registry.KERNELS, ids=lambda k: k.name)
def test_the_chosen_variant_builds_where_the_cpu_supports_it(kernel):
    """Where the CPU has a variant's instructions, a failed build is a bug, not a silent slow path."""
    variant, why = kernel.choose()
    if variant is None:
        pytest.skip(why)
    assert kernel.unavailable_reason() is None
    assert kernel.loaded_isa() == variant.isa


def test_a_process_keeps_the_variant_it_loaded(monkeypatch):
    """Its ops are registered once per process: a test that pretends another CPU afterwards must
    neither build a second variant nor be told the other one runs (genfast.kernels.qlinear.ops.
    dynamic_activation_max follows the variant in use)."""
    if not QLINEAR.available():
        pytest.skip(QLINEAR.unavailable_reason())
    loaded = QLINEAR.loaded_isa()
    pretend_cpu(monkeypatch, ZEN3 if loaded == "avx512" else ZEN4)
    assert chosen(QLINEAR) != loaded

    def build(*args):
        raise AssertionError("a second variant was built")

    monkeypatch.setattr(native, "_build", build)
    assert QLINEAR.available() and QLINEAR.loaded_isa() == loaded


LOWER_LEVELS = hardware.lower_levels(hardware.isa())
# The kernels' own tests: each variant against its reference and the portable path; and oneDNN's
# int8 convolution, whose AVX2 code saturates where its VNNI code does not.
VARIANT_TESTS = [
    "tests/quant/test_linear.py",
    "tests/quant/test_conv.py",
    "tests/test_nn.py",
    "tests/sam/test_attention.py",
    "tests/diffusion/test_group_norm.py",
    "tests/llm/model/test_decode_attention.py",
    "tests/kernels/test_upsampled_masks.py",
]
# AVX-512 is a lower level only below AMX, where only the int8 linear's and the attention's
# variants change (the other kernels have no AMX variant and ran their AVX-512 one in this run
# already).
LEVEL_TESTS = {
    "avx512": [
        "tests/quant/test_linear.py",
        "tests/sam/test_attention.py",
        "tests/sam/sam2/test_encoder_parts.py",
        "tests/diffusion/test_attention_kernel.py",
    ]
}


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
        [sys.executable, "-c", "from genfast.kernels.qlinear.ops import KERNEL; print(KERNEL.loaded_isa())"],
        env=env,
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=True,
    )
    assert probe.stdout.split()[-1] == ("None" if level == "none" else level)  # qlinear has every level but none
    run = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-x", *LEVEL_TESTS.get(level, VARIANT_TESTS)],
        env=env,
        cwd=ROOT,
        capture_output=True,
        text=True,
    )
    assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-2000:]


def test_saved_compiled_code_depends_on_the_kernel_sources(tmp_path, monkeypatch):
    # A packed weight layout lives in a kernel's source and in its ops.py together: code compiled
    # against one build must not be loaded beside another.
    from genfast.compilation import artifacts

    pretend_cpu(monkeypatch, ZEN3)
    monkeypatch.delenv(native.DISABLE_ENV, raising=False)
    for source in native.SOURCE_DIR.glob("*/*"):
        if source.suffix in (".cpp", ".h"):
            (tmp_path / source.parent.name).mkdir(exist_ok=True)
            (tmp_path / source.parent.name / source.name).write_bytes(source.read_bytes())
    monkeypatch.setattr(native, "SOURCE_DIR", tmp_path)
    before = artifacts.environment()["kernels"]
    assert before["qlinear"].startswith("genfast_qlinear_avx2_")
    with open(tmp_path / "qlinear" / "qlinear.h", "a") as header:
        header.write("// changed\n")
    after = artifacts.environment()["kernels"]
    assert after["qlinear"] != before["qlinear"] and after["group_norm"] == before["group_norm"]  # its own headers
    with open(tmp_path / native.COMMON / "avx2_vectors.h", "a") as header:
        header.write("// changed\n")
    shared = artifacts.environment()["kernels"]
    assert all(shared[name] != after[name] for name in after if after[name])  # and the shared ones
    (tmp_path / "qlinear" / "avx2.cpp").unlink()
    assert artifacts.environment()["kernels"]["qlinear"] is None  # no source: nothing to build, nothing saved against
