"""The text corpus that ships with every Python: the documentation topics in `pydoc_data`.

Used for the benchmark prompt, GPTQ calibration and perplexity. Calibration and evaluation use
disjoint halves, so a quantizer is never scored on the text it was fitted to:
the topics in sorted key order, joined by blank lines; characters [0, len/2) are the calibration
half and [len/2, len) the evaluation half.
"""

from __future__ import annotations

from functools import cache


@cache
def pydoc_text() -> str:
    from pydoc_data.topics import topics

    return "\n\n".join(topics[k] for k in sorted(topics))


def calibration_text() -> str:
    text = pydoc_text()
    return text[: len(text) // 2]


def evaluation_text() -> str:
    text = pydoc_text()
    return text[len(text) // 2 :]
