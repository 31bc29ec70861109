"""CUDA's kernels, written in Triton (compiled on first use; imported only where a GPU uses them)."""
