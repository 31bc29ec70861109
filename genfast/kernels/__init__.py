"""genfast's own kernels: native CPU kernels with a variant per ISA level, chosen at run time, and
CUDA's Triton kernels.

A native kernel is one folder, genfast/kernels/<name>/:
- `<isa>.cpp` per variant (`avx2.cpp`, `avx512.cpp`; an ARM one would be `neon.cpp` or `sve.cpp`),
  each registering the same ops for the CPU with TORCH_LIBRARY_IMPL, and the headers they share;
- `ops.py`: its `KERNEL` (native.Kernel: the variants, best first, and what each needs beyond its
  ISA level), the ops' schemas (torch.library) and fake implementations, so that the ops exist and
  torch.compile traces them whether or not a variant could be built, which inputs the kernel
  takes, the portable PyTorch path that runs without a variant (where the op has one of its own;
  the linears' is aten's, chosen by genfast.nn and genfast.quant) and per-variant facts (e.g. the
  dtypes each computes in).
`native` chooses, builds and loads a variant; `registry` finds the kernels from their folders.
Headers every kernel may use (vector helpers per ISA) are in common/; `int4_words` is the int4
word form the CUDA kernels share.

Adding a variant: write `<isa>.cpp` in the kernel's folder and list it in its `KERNEL`; a new ISA
level goes into genfast.platform.hardware.ISA_TREE with its CPU and compiler flags.

CUDA's kernels are Triton's (triton/, imported only where a GPU uses them): they compile on first
use through Triton and need nothing from the registry.

Nothing here imports a workload or genfast.quant: they call the kernels, never the reverse.
"""
