"""The process-wide settings every genfast process makes before any work: the command line's and
each bench row's (`python -m genfast.bench`), so that a row runs as the command would."""

from __future__ import annotations


def prepare_process() -> None:
    """Inductor's compiled kernels cached on disk (genfast/compilation/inductor.py), and malloc's
    thresholds settled at glibc's own ceiling, or raised further where GENFAST_KEEP_FREED_MEMORY=1
    asks (genfast/platform/heap.py)."""
    from genfast.compilation.inductor import use_persistent_cache
    from genfast.platform.heap import keep_freed_memory, settle_thresholds

    use_persistent_cache()
    keep_freed_memory()
    settle_thresholds()
