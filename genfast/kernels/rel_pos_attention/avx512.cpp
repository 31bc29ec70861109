// The AVX-512 variant: avx512.h has the attention, with the bf16 products on vdpbf16ps.

#include <torch/library.h>

#include "avx512.h"

TORCH_LIBRARY_IMPL(genfast, CPU, m) {
  m.impl("rel_pos_attention", &genfast_rel_pos_attention::rel_pos_attention<attend<VectorProducts>>);
  m.impl("attention", &genfast_rel_pos_attention::attention<attend<VectorProducts>>);
}
