"""genfast.platform.heap: with keep_freed_memory(), a large tensor allocated again after it was
freed reuses memory already faulted in. Each case runs in its own interpreter: the malloc
settings are process-wide."""

import subprocess
import sys

import pytest

# Fills a 64 MB tensor (above glibc's largest dynamic mmap threshold, 32 MB), frees it, fills a
# new one and prints the page faults of the second fill per 4 KB page of it.
SCRIPT = """
import resource, sys, torch
from genfast.platform.heap import keep_freed_memory
kept = keep_freed_memory()
pages = (64 << 20) // 4096
def fill():
    torch.ones(64 << 20, dtype=torch.uint8)
fill()
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
fill()
faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before
print(kept, faults / pages)
"""


def _second_fill(env: dict[str, str]) -> tuple[bool, float]:
    import os

    out = subprocess.run(
        [sys.executable, "-c", SCRIPT], env={**os.environ, **env}, capture_output=True, text=True, check=True
    )
    kept, faults_per_page = out.stdout.split()
    return kept == "True", float(faults_per_page)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's malloc settings (Linux)")
def test_a_freed_large_block_is_reused_without_faulting_it_in_again():
    kept, faults_per_page = _second_fill({})
    assert kept
    assert faults_per_page < 0.05


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's malloc settings (Linux)")
def test_turned_off_by_the_environment():
    kept, faults_per_page = _second_fill({"GENFAST_KEEP_FREED_MEMORY": "0"})
    assert not kept
    # glibc's default: mapped afresh, so the fill faults in (nearly) every page again; with
    # transparent huge pages on for every mapping it would fault 2 MB pages instead.
    from genfast.platform import hugepages

    if hugepages.thp_mode() != "always":
        assert faults_per_page > 0.9
