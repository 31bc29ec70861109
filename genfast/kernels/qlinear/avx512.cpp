// The AVX-512 (VNNI) variant: avx512.h has the math and the packed weight layout.

#include <torch/library.h>

#include "avx512.h"

// The schema is defined on the Python side (ops.py).
TORCH_LIBRARY_IMPL(genfast, CPU, m) {
  m.impl("qlinear", &genfast_qlinear::qlinear<Avx512>);
  m.impl("qlinear_dynamic", &genfast_qlinear::qlinear_dynamic<Avx512>);
}
