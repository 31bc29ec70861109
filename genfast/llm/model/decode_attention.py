"""When an LLM builds the native decode attention kernel (genfast/kernels/decode_attention/)."""

from __future__ import annotations

from genfast.kernels.decode_attention import ops


def build_for(head_dim: int) -> None:
    """Build the kernel now (first use on this machine) where a model with heads of `head_dim` will
    call it: a load does this, so that the build does not land between the first streamed words."""
    if ops.takes_head_dim(head_dim):
        ops.kernel_available()
