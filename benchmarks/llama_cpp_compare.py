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

`--alternate none|int8|int4` times genfast (`--dtype auto`, compiled, unquantized or `--quant`) and
llama.cpp (F16, Q8_0, Q4_0) in one process, taking turns: `--repeats` rounds of one prefill and
`--new-tokens` decode steps each, and prints every round's pair and the median of the per-round
ratios. On a shared host whose memory bandwidth drifts by tens of percent over minutes, the
pairs compare the two under the same conditions where separate runs do not.

`--shape NAME` (one of genfast's `random:` shapes, e.g. llama-3.2-1b) compares at a larger size
without downloading one: the F16 file then holds random weights at that shape's body (widths,
blocks, heads, tied head or not) with the source GGUF's tokenizer, so the vocabulary and the
embedding are the source's size. Both programs run that same file.
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


def write_random_gguf(source: Path, shape: str, out: Path) -> Path:
    """An F16 GGUF with N(0, 0.02) weights (norms one) at `shape`'s body and `source`'s tokenizer."""
    import gguf
    import numpy as np

    from genfast.llm.checkpoints.random_model import SHAPES

    if out.exists():
        return out
    config = SHAPES[shape]
    reader = gguf.GGUFReader(source)
    vocab = len(reader.fields["tokenizer.ggml.tokens"].contents())
    dim, hidden, heads, kv_heads = (
        config[k] for k in ("hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads")
    )
    head_dim = dim // heads
    writer = gguf.GGUFWriter(out, "llama")
    writer.add_name(f"random {shape} body, {source.name} tokenizer")
    writer.add_file_type(gguf.LlamaFileType.MOSTLY_F16)
    writer.add_context_length(min(config["max_position_embeddings"], 8192))
    writer.add_embedding_length(dim)
    writer.add_block_count(config["num_hidden_layers"])
    writer.add_feed_forward_length(hidden)
    writer.add_head_count(heads)
    writer.add_head_count_kv(kv_heads)
    writer.add_rope_freq_base(config["rope_theta"])
    writer.add_rope_dimension_count(head_dim)
    writer.add_layer_norm_rms_eps(config["rms_norm_eps"])
    writer.add_vocab_size(vocab)
    for key, field in reader.fields.items():
        if key.startswith("tokenizer."):
            element_type = field.types[1] if len(field.types) > 1 else None
            writer.add_key_value(key, field.contents(), field.types[0], element_type)
    rng = np.random.default_rng(0)

    def weight(rows: int, cols: int) -> np.ndarray:
        return (rng.standard_normal((rows, cols), dtype=np.float32) * 0.02).astype(np.float16)

    ones = np.ones(dim, dtype=np.float32)
    writer.add_tensor("token_embd.weight", weight(vocab, dim))
    for i in range(config["num_hidden_layers"]):
        for name, rows, cols in (
            ("attn_q", dim, dim),
            ("attn_k", kv_heads * head_dim, dim),
            ("attn_v", kv_heads * head_dim, dim),
            ("attn_output", dim, dim),
            ("ffn_gate", hidden, dim),
            ("ffn_up", hidden, dim),
            ("ffn_down", dim, hidden),
        ):
            writer.add_tensor(f"blk.{i}.{name}.weight", weight(rows, cols))
        writer.add_tensor(f"blk.{i}.attn_norm.weight", ones)
        writer.add_tensor(f"blk.{i}.ffn_norm.weight", ones)
    writer.add_tensor("output_norm.weight", ones)
    if not config["tie_word_embeddings"]:
        writer.add_tensor("output.weight", weight(vocab, dim))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return out


def last_argmax(llm) -> int:
    """Greedy token from the last evaluated position's logits (only those are computed)."""
    import numpy as np

    logits = np.ctypeslib.as_array(llm._ctx.get_logits(), shape=(llm.n_vocab(),))
    return int(np.argmax(logits))


def open_llama(path: Path, threads: int, prompt_tokens: int, new_tokens: int):
    """A llama.cpp context sized for one prompt of `prompt_tokens` (one batch) and `new_tokens` steps."""
    from llama_cpp import Llama

    return Llama(
        str(path),
        n_ctx=prompt_tokens + new_tokens + 8,
        n_batch=prompt_tokens,
        n_threads=threads,
        n_threads_batch=threads,
        verbose=False,
    )


def llama_round(llm, prompt: list[int], new_tokens: int) -> tuple[float, float]:
    """(prefill tok/s, decode tok/s) of one prompt in one batch and `new_tokens` greedy steps."""
    llm.reset()
    t0 = time.perf_counter()
    llm.eval(prompt)
    t1 = time.perf_counter()
    token = last_argmax(llm)
    for _ in range(new_tokens):
        llm.eval([token])
        token = last_argmax(llm)
    return len(prompt) / (t1 - t0), new_tokens / (time.perf_counter() - t1)


def measure(
    path: Path, threads: int, prompt_text: str, prompt_tokens: int, new_tokens: int, repeats: int
) -> tuple[float, float]:
    """(prefill tok/s, decode tok/s), medians."""
    llm = open_llama(path, threads, prompt_tokens, new_tokens)
    prompt = llm.tokenize(prompt_text.encode(), add_bos=False)[:prompt_tokens]
    rounds = [llama_round(llm, prompt, new_tokens) for _ in range(repeats + 1)][1:]  # the first warms up
    return statistics.median(r[0] for r in rounds), statistics.median(r[1] for r in rounds)


LLAMA_TYPE = {"none": "F16", "int8": "Q8_0", "int4": "Q4_0"}


def alternate(source: Path, workdir: Path, quant: str, args: argparse.Namespace, prompt_text: str) -> None:
    """genfast and llama.cpp in turns in this process, on the same weights (see the docstring)."""
    from genfast.compilation.inductor import use_persistent_cache
    from genfast.llm.decoding.precompiled import attach
    from genfast.llm.decoding.sampling import SamplingParams
    from genfast.llm.loading import load
    from genfast.llm.recipe import make_generator

    name = LLAMA_TYPE[quant]
    path = source if name == "F16" else convert(source, workdir / f"{name}.gguf", name)
    llm = open_llama(path, args.threads, args.prompt_tokens, args.new_tokens)
    llama_prompt = llm.tokenize(prompt_text.encode(), add_bos=False)[: args.prompt_tokens]

    import torch

    torch.set_num_threads(args.threads)
    use_persistent_cache()
    loaded = load(str(source), "cpu", "auto", quant=quant)
    prompt = loaded.tokenizer.encode(prompt_text)[: args.prompt_tokens]
    generator = make_generator(loaded, len(prompt) + args.new_tokens + 8, 1, compile=True)
    attach(generator, loaded, SamplingParams(), print)  # the steps `genfast generate` runs
    generator.warmup()

    def genfast_round() -> tuple[float, float]:
        result = generator.generate([prompt], args.new_tokens, stop_at_eos=False)
        return result.prefill_tok_s, result.decode_tok_s

    def llama_turn() -> tuple[float, float]:
        return llama_round(llm, llama_prompt, args.new_tokens)

    with torch.inference_mode():
        genfast_round(), llama_turn()  # warm-up
        print(f"| round | genfast {quant} prefill / decode tok/s | llama.cpp {name} prefill / decode tok/s |")
        print("|---|---|---|")
        ratios: dict[str, list[float]] = {"prefill": [], "decode": []}
        for i in range(args.repeats):
            first, second = (genfast_round, llama_turn) if i % 2 == 0 else (llama_turn, genfast_round)
            results = {first: first(), second: second()}
            ours, theirs = results[genfast_round], results[llama_turn]
            print(f"| {i + 1} | {ours[0]:.0f} / {ours[1]:.1f} | {theirs[0]:.0f} / {theirs[1]:.1f} |", flush=True)
            ratios["prefill"].append(ours[0] / theirs[0])
            ratios["decode"].append(ours[1] / theirs[1])
    for what, values in ratios.items():
        print(
            f"{what}: genfast / llama.cpp median {statistics.median(values):.2f}x "
            f"(rounds {min(values):.2f}-{max(values):.2f}x)"
        )


def main() -> None:
    from genfast.llm.corpus import pydoc_text
    from genfast.platform.hardware import cpu_model, describe_isa

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--gguf", type=Path, required=True, help="source GGUF (e.g. the Q4_1 SmolLM2 genfast uses)")
    p.add_argument(
        "--shape", default=None, help="random weights at this random: shape (e.g. llama-3.2-1b), --gguf's tokenizer"
    )
    p.add_argument("--workdir", type=Path, default=None, help="where the converted files go (default: next to --gguf)")
    p.add_argument("--types", default="F16,Q8_0,Q4_0")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--prompt-tokens", type=int, default=512)
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--alternate", choices=sorted(LLAMA_TYPE), default=None, help="genfast and llama.cpp in turns")
    args = p.parse_args()
    workdir = args.workdir or args.gguf.parent
    workdir.mkdir(parents=True, exist_ok=True)
    text = pydoc_text()[: args.prompt_tokens * 8]
    import llama_cpp

    built_for = llama_cpp.llama_print_system_info().decode().strip().rstrip("|").strip()
    print(
        f"llama.cpp {llama_cpp.__version__} ({built_for}) on {cpu_model()}, ISA {describe_isa()}, "
        f"{args.threads} threads; {args.prompt_tokens}-token prompt, {args.new_tokens} new tokens, "
        f"median of {args.repeats}"
    )
    if args.shape:
        source = write_random_gguf(args.gguf, args.shape, workdir / "F16.gguf")
    else:
        source = convert(args.gguf, workdir / "F16.gguf", "F16")  # every type from the same F16 weights
    if args.alternate:
        alternate(source, workdir, args.alternate, args, text)
        return
    print("| type | prefill tok/s | decode tok/s |\n|---|---|---|")
    for name in args.types.split(","):
        path = source if name == "F16" else convert(source, workdir / f"{name}.gguf", name)
        prefill, decode = measure(path, args.threads, text, args.prompt_tokens, args.new_tokens, args.repeats)
        print(f"| {name} | {prefill:.0f} | {decode:.1f} |", flush=True)


if __name__ == "__main__":
    main()
