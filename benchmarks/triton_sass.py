"""Instructions per byte of codes in the loops of genfast's Triton int8/int4 kernels, counted
without a GPU.

    python benchmarks/triton_sass.py [--arch 90] [--kernel one-row|few-row] [--rows 8]
                                     [--configs default|sweep] [--k 4096] [--formats ...]

Decode's int8/int4 matrix-vector product on an H100 is bound by instruction issue before memory:
132 SMs issue 128 thread-instructions per cycle each, and streaming ~3 TB/s of codes at ~1.98 GHz
means ~12 bytes per SM and cycle, so a loop of more than ~10 instructions per byte cannot keep up
even at full issue (docs/notes.md, "CUDA's one-row int8/int4 kernel by instruction count"). Triton ships
ptxas and cuobjdump, so the kernel compiles for an sm_90 target on any machine: this script
compiles `genfast.kernels.triton.qlinear._gemv` (`--kernel few-row`: `_gemm`, for `--rows`
rows) for each configuration (integer arguments marked
divisible by 16, as Triton's launcher specializes them for these shapes), finds the loop (the
widest backward branch of the SASS), and divides its instruction count by the bytes of codes one
thread reads per pass. It also prints the bytes the loop loads per byte of codes (codes, x and the
grid: every load goes through L1, and x is loaded once per output row), registers, stack bytes
(spills), and the loop's shared-memory traffic and barriers, which mark a layout conversion
inside the loop (the few-row kernel's are its operands for tl.dot, by design), and how many of its
programs fit one SM and the warps an H100's SMs then hold for a 4096-row matrix. A count is a
prediction, not a timing:
`benchmarks/cuda_linear.py --sweep` times the same configurations on a GPU.
"""

from __future__ import annotations

import argparse
import collections
import os
import re
import subprocess
import tempfile
from dataclasses import dataclass

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from genfast.kernels.triton.qlinear import _gemm, _gemv, gemm_config, gemm_launch, gemv_config, gemv_launch, sub_block

# As `qlinear` launches it for bf16 activations (x cast to fp32 before, the output in bf16).
SIGNATURE = {
    "x_ptr": "*fp32", "codes_ptr": "*u8", "scales_ptr": "*fp16", "mins_ptr": "*fp16", "x_sums_ptr": "*fp32",
    "out_ptr": "*bf16",
    "N": "i32", "K": "i32", "K_SPLIT": "i32", "stride_codes": "i32", "stride_grid": "i32", "exponent": "i32",
}  # fmt: skip
FORMATS = {
    "int8 per channel": (8, None),
    "int4 g32": (4, 32),
    "int4 g128": (4, 128),
    "int8 g64": (8, 64),
    "int8 g32": (8, 32),  # GGUF's Q8_0, loaded as it is
}
K = 4096  # Llama-2-7B's hidden size: every linear but the down projection


@dataclass
class LoopCount:
    instructions: int
    by_opcode: collections.Counter
    registers: int
    stack_bytes: int  # spilled registers live there


def compile_for(kernel, signature: dict, constants: dict, arch: int):
    """`kernel` compiled for sm_`arch` (no GPU needed) with `constants` (num_warps among them),
    its pointer and integer arguments marked divisible by 16, as Triton's launcher specializes them
    for these shapes."""
    constants = dict(constants)
    num_warps = constants.pop("num_warps")
    divisible = {(i,): [["tt.divisibility", 16]] for i in range(len(signature))}
    source = ASTSource(kernel, dict(signature, **dict.fromkeys(constants, "constexpr")), constants, divisible)
    options = {"num_warps": num_warps, "enable_fp_fusion": True}  # Triton's default before 3.10
    return triton.compile(source, target=GPUTarget("cuda", arch, 32), options=options)


def codes_type(bits: int) -> str:
    return "*u8" if bits == 8 else "*i32"  # int4: words (genfast.kernels.triton.qlinear.store_codes)


def compile_gemm(bits: int, group: int | None, dtype: str, rows: int, arch: int, k: int = K, config=None):
    """The few-row kernel as `qlinear` launches it for `rows` rows of a k-wide input in `dtype`
    ("bf16", "fp16" or "fp32"), with `config` (gemm_config's keys; None: its defaults for a 4096 x k
    weight), compiled: what a GPU would build first."""
    config = config or gemm_config(rows, 4096, k, bits)
    constants, _, _ = gemm_launch(k, bits, group or k, config)
    signature = {
        "x_ptr": f"*{dtype}", "codes_ptr": codes_type(bits), "scales_ptr": "*fp16", "mins_ptr": "*fp16",
        "out_ptr": f"*{dtype}", "M": "i32", "N": "i32", "K": "i32", "K_SPLIT": "i32", "stride_x": "i32",
        "stride_out": "i32", "stride_codes": "i32", "stride_grid": "i32", "exponent": "i32",
    }  # fmt: skip
    return compile_for(_gemm, signature, dict(constants, IEEE=dtype == "fp32"), arch)


def compile_gemv(bits: int, group: int | None, config: dict, arch: int, k: int = K):
    """The one-row kernel as `qlinear` launches it for a k-wide input, compiled."""
    constants, _, _ = gemv_launch(k, bits, group or k, {**config, "SPLIT_K": 1})
    return compile_for(_gemv, dict(SIGNATURE, codes_ptr=codes_type(bits)), constants, arch)


def count_kernel(kernel) -> LoopCount:
    """A compiled kernel's K loop, counted: its SASS (Triton's cuobjdump) and resources."""
    with tempfile.TemporaryDirectory() as folder:
        cubin = os.path.join(folder, "kernel.cubin")
        with open(cubin, "wb") as f:
            f.write(kernel.asm["cubin"])
        cuobjdump = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
        sass = subprocess.run([cuobjdump, "-sass", cubin], capture_output=True, text=True, check=True).stdout
        usage = subprocess.run([cuobjdump, "-res-usage", cubin], capture_output=True, text=True, check=True).stdout
    registers, stack = (int(re.search(rf"{key}:(\d+)", usage).group(1)) for key in ("REG", "STACK"))
    return LoopCount(*count_loop(sass), registers, stack)


INSTRUCTION = re.compile(r"\s*/\*([0-9a-f]{4,})\*/\s+(?:@!?U?P\w+\s+)?([A-Z0-9_.]+)([^;]*);")


def count_loop(sass: str) -> tuple[int, collections.Counter]:
    """The instructions between the widest backward branch and its target: the K loop."""
    lines = [(int(m.group(1), 16), m.group(2), m.group(3)) for m in map(INSTRUCTION.match, sass.splitlines()) if m]
    branches = []
    for address, opcode, operands in lines:
        target = re.search(r"0x([0-9a-f]+)", operands)
        if opcode == "BRA" and target and int(target.group(1), 16) < address:
            branches.append((int(target.group(1), 16), address))
    if not branches:
        raise RuntimeError("no loop found in the kernel's SASS")
    low, high = max(branches, key=lambda b: b[1] - b[0])
    by_opcode = collections.Counter(
        opcode if opcode.startswith(("LDG", "LDS", "STS")) else opcode.split(".")[0]
        for address, opcode, _ in lines
        if low <= address <= high
    )
    return sum(by_opcode.values()), by_opcode


def load_bytes(by_opcode: collections.Counter) -> int:
    """Bytes one thread loads from global memory per pass: the loop's LDGs (LDGSTS: the few-row
    kernel's asynchronous copies to shared memory) by their width."""

    def width(opcode: str) -> int:
        for suffix, size in ((".128", 16), (".64", 8), ("16", 2), ("8", 1)):
            if opcode.endswith(suffix):
                return size
        return 4

    loads = (op for op in by_opcode if op.startswith("LDG") and not op.startswith("LDGDEPBAR"))
    return sum(by_opcode[op] * width(op) for op in loads)


def bytes_per_pass(bits: int, config: dict, k: int = K, group: int | None = None) -> float:
    """Bytes of codes one thread reads per pass of the loop (its sub-blocks as gemv_launch cuts k)."""
    gs, ng = sub_block(k, group or k, config["SUB"], bits)
    codes = config["BLOCK_N"] * gs * ng * config.get("UNROLL", 1) / (2 if bits == 4 else 1)
    return codes / (32 * config["num_warps"])


# An H100 SXM's multiprocessors and what each holds (sm_90): registers, shared memory, warps, programs.
SMS, SM_REGISTERS, SM_SHARED, SM_WARPS, SM_PROGRAMS = 132, 65536, 228 * 1024, 64, 32


def warps_per_sm(registers: int, shared: int, num_warps: int, programs: int) -> tuple[int, float]:
    """The programs of a kernel with `registers` per thread and `shared` bytes of shared memory
    that fit on one SM (registers allocated 8 per thread at a time; shared memory with the 1 KB a
    program reserves), and the warps an SM then holds on average when `programs` are launched over
    an H100's 132 SMs. Fewer than ~4 per scheduler (16 per SM) leave memory and instruction
    latencies exposed: each scheduler issues only from the warps it holds."""
    registers = -(-registers // 8) * 8
    fit = min(SM_PROGRAMS, SM_WARPS // num_warps, SM_REGISTERS // (registers * 32 * num_warps),
              SM_SHARED // (shared + 1024))  # fmt: skip
    return fit, min(fit, programs / SMS) * num_warps


def configs(kind: str, kernel: str, bits: int, k: int, rows: int) -> list[dict]:
    if kernel == "few-row":
        if kind == "default":
            return [gemm_config(rows, 4096, k, bits)]
        block_m = gemm_config(rows, 4096, k, bits)["BLOCK_M"]
        return [
            dict(BLOCK_M=block_m, BLOCK_N=n, SUB=sub, num_warps=w)
            for n in (16, 32, 64, 128)
            for sub in (128, 256)
            for w in (2, 4, 8)
        ]
    if kind == "default":
        return [gemv_config(4096, k, bits)]
    return [
        dict(BLOCK_N=n, UNROLL=u, SUB=sub, num_warps=w)
        for n in (8, 16, 32)
        for u in (1, 2)
        for sub in (256, 512, 1024, 2048)
        for w in (2, 4, 8)
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--arch", type=int, default=90, help="SM version to compile for (90: H100/H200)")
    parser.add_argument("--kernel", choices=("one-row", "few-row"), default="one-row")
    parser.add_argument("--rows", type=int, default=8, help="the few-row kernel's rows (2-64)")
    parser.add_argument("--configs", choices=("default", "sweep"), default="default")
    parser.add_argument("--formats", default=",".join(FORMATS))
    parser.add_argument("--k", type=int, default=K, help="the input width (11008: Llama-2-7B's down projection)")
    args = parser.parse_args()
    rows = f", {args.rows} rows" if args.kernel == "few-row" else ""
    print(f"Triton {triton.__version__}, sm_{args.arch}, {args.kernel} kernel{rows}, K = {args.k}, bf16 activations\n")
    print("| format | block sizes | instructions per byte of codes | bytes loaded per byte of codes "
          "| registers | stack bytes | programs that fit an SM | warps per SM, 4096 rows | in the loop |")  # fmt: skip
    print("|---|---|---|---|---|---|---|---|---|")
    for name in args.formats.split(","):
        bits, group = FORMATS[name]
        for config in configs(args.configs, args.kernel, bits, args.k, args.rows):
            if args.kernel == "few-row":
                compiled = compile_gemm(bits, group, "bf16", args.rows, args.arch, args.k, config)
                _, splits, _ = gemm_launch(args.k, bits, group or args.k, config)
                programs = splits * triton.cdiv(4096, config["BLOCK_N"]) * triton.cdiv(args.rows, config["BLOCK_M"])
            else:
                compiled = compile_gemv(bits, group, config, args.arch, args.k)
                programs = config.get("SPLIT_K", 1) * triton.cdiv(4096, config["BLOCK_N"])
            count = count_kernel(compiled)
            fit, warps = warps_per_sm(count.registers, compiled.metadata.shared, config["num_warps"], programs)
            codes = bytes_per_pass(bits, config, args.k, group)
            per_byte, loaded = count.instructions / codes, load_bytes(count.by_opcode) / codes
            top = ", ".join(f"{op} {n}" for op, n in count.by_opcode.most_common(6))
            resources = f"{count.registers} | {count.stack_bytes} | {fit} | {warps:.1f}"
            print(f"| {name} | {config} | {per_byte:.1f} | {loaded:.1f} | {resources} | {top} |")


if __name__ == "__main__":
    main()
