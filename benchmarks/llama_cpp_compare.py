"""llama.cpp's decode and prefill on the same weights genfast runs, for side-by-side tables.

    pip install llama-cpp-python      # into any environment (not a genfast dependency)
    python benchmarks/llama_cpp_compare.py --gguf SmolLM2-135M-Instruct.Q4_1.gguf --threads 2

From the given GGUF it writes F16, Q8_0 and Q4_0 copies (llama.cpp's own quantizer; F16 holds the
dequantized source weights, which is what genfast's unquantized and --quant paths start from),
then times, per type: a `--prompt-tokens` prompt (the pydoc text `genfast bench llm` uses) in one
batch, and `--new-tokens` greedy single-token steps. Medians of `--repeats`. Run genfast on the
F16 file: `genfast bench llm --model <dir>/F16.gguf --threads 2 --prompt-tokens 512 --steps
compile,int8,int4` (with `--dtype float32` on a CPU without native bf16, where the quantized
kernels are fastest with fp32 activations).
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

FTYPES = {"F16": 1, "Q8_0": 7, "Q4_0": 2}  # llama_ftype values


def convert(source: Path, out: Path, name: str) -> Path:
    import llama_cpp

    if out.exists():
        return out
    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = FTYPES[name]
    params.allow_requantize = True
    params.nthread = 2
    if llama_cpp.llama_model_quantize(str(source).encode(), str(out).encode(), params) != 0:
        raise SystemExit(f"llama.cpp could not write {out}")
    return out


def last_argmax(llm) -> int:
    """Greedy token from the last evaluated position's logits (only those are computed)."""
    import numpy as np

    logits = np.ctypeslib.as_array(llm._ctx.get_logits(), shape=(llm.n_vocab(),))
    return int(np.argmax(logits))


def measure(
    path: Path, threads: int, prompt_text: str, prompt_tokens: int, new_tokens: int, repeats: int
) -> tuple[float, float]:
    """(prefill tok/s, decode tok/s), medians."""
    from llama_cpp import Llama

    llm = Llama(
        str(path),
        n_ctx=prompt_tokens + new_tokens + 8,
        n_batch=prompt_tokens,
        n_threads=threads,
        n_threads_batch=threads,
        verbose=False,
    )
    prompt = llm.tokenize(prompt_text.encode(), add_bos=False)[:prompt_tokens]
    prefill, decode = [], []
    for _ in range(repeats + 1):  # the first round warms up
        llm.reset()
        t0 = time.perf_counter()
        llm.eval(prompt)
        t1 = time.perf_counter()
        token = last_argmax(llm)
        for _ in range(new_tokens):
            llm.eval([token])
            token = last_argmax(llm)
        t2 = time.perf_counter()
        prefill.append(len(prompt) / (t1 - t0))
        decode.append(new_tokens / (t2 - t1))
    return statistics.median(prefill[1:]), statistics.median(decode[1:])


def main() -> None:
    from genfast.hardware import cpu_model, describe_isa
    from genfast.llm.corpus import pydoc_text

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--gguf", type=Path, required=True, help="source GGUF (e.g. the Q4_1 SmolLM2 genfast uses)")
    p.add_argument("--workdir", type=Path, default=None, help="where the converted files go (default: next to --gguf)")
    p.add_argument("--types", default="F16,Q8_0,Q4_0")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--prompt-tokens", type=int, default=512)
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--repeats", type=int, default=3)
    args = p.parse_args()
    workdir = args.workdir or args.gguf.parent
    workdir.mkdir(parents=True, exist_ok=True)
    text = pydoc_text()[: args.prompt_tokens * 8]
    print(
        f"llama.cpp on {cpu_model()}, ISA {describe_isa()}, {args.threads} threads; "
        f"{args.prompt_tokens}-token prompt, {args.new_tokens} new tokens, median of {args.repeats}"
    )
    print("| type | prefill tok/s | decode tok/s |\n|---|---|---|")
    source = convert(args.gguf, workdir / "F16.gguf", "F16")  # every type from the same F16 weights
    for name in args.types.split(","):
        path = source if name == "F16" else convert(source, workdir / f"{name}.gguf", name)
        prefill, decode = measure(path, args.threads, text, args.prompt_tokens, args.new_tokens, args.repeats)
        print(f"| {name} | {prefill:.0f} | {decode:.1f} |", flush=True)


if __name__ == "__main__":
    main()
