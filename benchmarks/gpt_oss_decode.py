"""gpt-oss-20b decode on this CPU from MXFP4 expert weights: genfast against llama.cpp, one GGUF.

    python benchmarks/gpt_oss_decode.py write --out /tmp/gpt-oss-20b-random.gguf
    python benchmarks/gpt_oss_decode.py predict
    python benchmarks/gpt_oss_decode.py genfast --gguf /tmp/gpt-oss-20b-random.gguf
    /work/bench-venv/bin/python benchmarks/gpt_oss_decode.py llama --gguf /tmp/gpt-oss-20b-random.gguf

`write` makes a GGUF at gpt-oss-20b's published shape (24 layers, hidden 2880, 64 query and 8 KV
heads of 64, 32 experts of width 2880 with top-4 routing, vocabulary 201088, a 128-token window on
alternate layers, YaRN) with random weights: the experts in MXFP4 (random codes, scales 2^-10 to
2^-7), the other matrices in BF16, norms, biases and sinks in F32, and a placeholder SentencePiece
vocabulary of the right size. Speed does not depend on the values. Both programs then run that
same file, one after the other (each holds ~13 GB: never both at once): `genfast` (genfast.llm's
gpt-oss family; the experts stay MXFP4ExpertLinear codes, the rest as `--dtype auto` keeps it,
decode compiled) and `llama` (llama-cpp-python, in an environment of its own). Each prints decode
tok/s over `--new-tokens` greedy steps after a short prompt (medians of `--repeats`), the bytes a
token reads, and the process's peak resident memory. `predict` prints the bytes-per-token model.
"""

from __future__ import annotations

import argparse
import platform
import resource
import statistics
import sys
import time
from pathlib import Path

SHAPE = dict(
    layers=24, dim=2880, heads=64, kv_heads=8, head_dim=64, experts=32, top_k=4, expert_width=2880,
    vocab=201088, window=128, context=131072, rope_theta=150000.0, yarn_factor=32.0, yarn_original=4096,
)  # fmt: skip
MXFP4_BYTES_PER_WEIGHT = 17 / 32


def bytes_per_token(context: int) -> dict[str, float]:
    """Bytes one decode step reads from memory at `context` tokens of cache, by part. Experts:
    top-k of each layer's gate-up and down stacks in MXFP4; attention q, k, v, o and the output
    head in BF16 (2 bytes), one embedding row, the router (F32), and the KV cache read (BF16, half
    the layers capped at the window)."""
    s = SHAPE
    dim, qdim, kvdim = s["dim"], s["heads"] * s["head_dim"], s["kv_heads"] * s["head_dim"]
    experts = s["layers"] * s["top_k"] * 3 * s["expert_width"] * dim * MXFP4_BYTES_PER_WEIGHT
    attention = s["layers"] * (dim * (qdim + 2 * kvdim) + qdim * dim) * 2
    head = s["vocab"] * dim * 2
    router = s["layers"] * s["experts"] * dim * 4
    cached = sum(min(context, s["window"]) if i % 2 == 0 else context for i in range(s["layers"]))
    kv_cache = cached * 2 * kvdim * 2
    return {"experts": experts, "attention": attention, "output head": head, "router": router, "kv cache": kv_cache}


def machine(threads: int) -> str:
    import torch

    from genfast.platform.hardware import cpu_model, describe_isa

    versions = f"torch {torch.__version__}, Python {platform.python_version()}"
    return f"{cpu_model()}, ISA {describe_isa()}, {threads} threads, {versions}"


def peak_rss_gib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # Linux: KiB


def resident() -> str:
    """The process's resident memory now, split into its own (anonymous) pages and pages of mapped
    files (a memory-mapped GGUF: the kernel can drop them, and they count in the peak RSS)."""
    fields = dict(line.split(":", 1) for line in Path("/proc/self/status").read_text().splitlines() if ":" in line)
    gib = {k: int(fields[k].split()[0]) / 2**20 for k in ("VmRSS", "RssAnon", "RssFile")}
    return f"{gib['VmRSS']:.2f} GiB ({gib['RssAnon']:.2f} anonymous, {gib['RssFile']:.2f} file-backed)"


def write(out: Path) -> None:
    import gguf
    import numpy as np

    s = SHAPE
    dim, qdim, kvdim = s["dim"], s["heads"] * s["head_dim"], s["kv_heads"] * s["head_dim"]
    width, experts = s["expert_width"], s["experts"]
    rng = np.random.default_rng(0)
    tensors: list[tuple[str, tuple[int, ...], str]] = [("token_embd.weight", (s["vocab"], dim), "bf16")]
    for i in range(s["layers"]):
        p = f"blk.{i}."
        tensors += [
            (p + "attn_norm.weight", (dim,), "norm"),
            (p + "attn_q.weight", (qdim, dim), "bf16"), (p + "attn_q.bias", (qdim,), "f32"),
            (p + "attn_k.weight", (kvdim, dim), "bf16"), (p + "attn_k.bias", (kvdim,), "f32"),
            (p + "attn_v.weight", (kvdim, dim), "bf16"), (p + "attn_v.bias", (kvdim,), "f32"),
            (p + "attn_output.weight", (dim, qdim), "bf16"), (p + "attn_output.bias", (dim,), "f32"),
            (p + "attn_sinks.weight", (s["heads"],), "f32"),
            (p + "post_attention_norm.weight", (dim,), "norm"),
            (p + "ffn_gate_inp.weight", (experts, dim), "f32"), (p + "ffn_gate_inp.bias", (experts,), "f32"),
            (p + "ffn_gate_exps.weight", (experts, width, dim), "mxfp4"),
            (p + "ffn_gate_exps.bias", (experts, width), "f32"),
            (p + "ffn_up_exps.weight", (experts, width, dim), "mxfp4"),
            (p + "ffn_up_exps.bias", (experts, width), "f32"),
            (p + "ffn_down_exps.weight", (experts, dim, width), "mxfp4"),
            (p + "ffn_down_exps.bias", (experts, dim), "f32"),
        ]  # fmt: skip
    tensors += [("output_norm.weight", (dim,), "norm"), ("output.weight", (s["vocab"], dim), "bf16")]

    def data(shape: tuple[int, ...], kind: str) -> np.ndarray:
        if kind == "norm":
            return np.ones(shape, dtype=np.float32)
        if kind == "f32":
            return (rng.standard_normal(shape, dtype=np.float32) * 0.02).astype(np.float32)
        if kind == "bf16":  # the top half of N(0, 0.02) fp32, a row block at a time
            out = np.empty(shape, dtype=np.uint16)
            for r in range(0, shape[0], 16384):
                rows = rng.standard_normal((min(16384, shape[0] - r), *shape[1:]), dtype=np.float32) * 0.02
                out[r : r + len(rows)] = (rows.view(np.uint32) >> 16).astype(np.uint16)
            return out
        e, n, k = shape  # MXFP4: per block one scale byte, then 16 bytes of random codes
        raw = rng.integers(0, 256, size=(e, n, k // 32, 17), dtype=np.uint8)
        raw[..., 0] = rng.integers(117, 121, size=(e, n, k // 32), dtype=np.uint8)
        return raw.reshape(e, n, k // 32 * 17)

    raw_type = {"bf16": gguf.GGMLQuantizationType.BF16, "mxfp4": gguf.GGMLQuantizationType.MXFP4}
    writer = gguf.GGUFWriter(out, "gpt-oss")
    writer.add_name("random weights at gpt-oss-20b's shape (benchmarks/gpt_oss_decode.py)")
    writer.add_context_length(s["context"])
    writer.add_embedding_length(dim)
    writer.add_block_count(s["layers"])
    writer.add_feed_forward_length(width)
    writer.add_head_count(s["heads"])
    writer.add_head_count_kv(s["kv_heads"])
    writer.add_key_length(s["head_dim"])
    writer.add_value_length(s["head_dim"])
    writer.add_rope_freq_base(s["rope_theta"])
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_expert_count(experts)
    writer.add_expert_used_count(s["top_k"])
    writer.add_expert_feed_forward_length(width)
    writer.add_sliding_window(s["window"])
    writer.add_rope_scaling_type(gguf.RopeScalingType.YARN)
    writer.add_rope_scaling_factor(s["yarn_factor"])
    writer.add_rope_scaling_orig_ctx_len(s["yarn_original"])
    # A placeholder SentencePiece vocabulary of the real size: token ids are all the benchmark uses.
    words = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)]
    words += [f"\u2581w{i}" for i in range(s["vocab"] - len(words))]
    writer.add_tokenizer_model("llama")
    writer.add_token_list(words)
    writer.add_token_scores([0.0] * len(words))
    writer.add_token_types([2, 3, 3] + [6] * 256 + [1] * (len(words) - 259))
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.add_unk_token_id(0)
    for name, shape, kind in tensors:
        if kind == "mxfp4":
            byte_shape = (*shape[:-1], shape[-1] // 32 * 17)
            writer.add_tensor_info(name, byte_shape, np.dtype(np.uint8), int(np.prod(byte_shape)), raw_type[kind])
        elif kind == "bf16":
            writer.add_tensor_info(name, shape, np.dtype(np.uint16), int(np.prod(shape)) * 2, raw_type[kind])
        else:
            writer.add_tensor_info(name, shape, np.dtype(np.float32), int(np.prod(shape)) * 4)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    for _, shape, kind in tensors:  # streamed: one tensor in memory at a time
        writer.write_tensor_data(data(shape, kind))
    writer.close()
    print(f"wrote {out} ({out.stat().st_size / 1e9:.2f} GB)")


def report(who: str, decode: list[float], context: int, threads: int) -> None:
    parts = bytes_per_token(context)
    total = sum(parts.values())
    med = statistics.median(decode)
    print(f"{who}: decode {med:.2f} tok/s (median of {len(decode)}: {', '.join(f'{d:.2f}' for d in decode)})")
    print(f"  bytes per token (model, at {context} cached): {total / 1e9:.2f} GB -> {total * med / 1e9:.1f} GB/s read")
    print(f"  peak RSS {peak_rss_gib():.2f} GiB; resident now {resident()}")


def run_genfast(path: Path, args: argparse.Namespace) -> None:
    import torch

    from genfast.compilation.inductor import use_persistent_cache
    from genfast.llm.decoding.precompiled import attach
    from genfast.llm.decoding.sampling import SamplingParams
    from genfast.llm.loading import load
    from genfast.llm.recipe import make_generator
    from genfast.quant.mxfp4 import MXFP4ExpertLinear

    torch.set_num_threads(args.threads)
    print(machine(args.threads))
    use_persistent_cache()
    t0 = time.perf_counter()
    loaded = load(str(path), "cpu", args.dtype)
    stacks = [m for m in loaded.model.modules() if isinstance(m, MXFP4ExpertLinear)]
    print(f"loaded in {time.perf_counter() - t0:.0f} s; {len(stacks)} MXFP4 expert stacks ({stacks[0].extra_repr()})")
    print(f"  resident now: {resident()}")
    prompt = list(range(300, 300 + args.prompt_tokens))
    generator = make_generator(loaded, len(prompt) + args.new_tokens + 8, 1, compile=not args.eager)
    attach(generator, loaded, SamplingParams(), print)
    t0 = time.perf_counter()
    generator.warmup()
    print(f"warm-up (compile) {time.perf_counter() - t0:.0f} s")
    decode = []
    with torch.inference_mode():
        for _ in range(args.repeats + 1):
            decode.append(generator.generate([prompt], args.new_tokens, stop_at_eos=False).decode_tok_s)
    report("genfast", decode[1:], args.prompt_tokens + args.new_tokens // 2, args.threads)


def run_llama(path: Path, args: argparse.Namespace) -> None:
    import llama_cpp
    import numpy as np

    built = llama_cpp.llama_print_system_info().decode().strip()
    print(f"llama.cpp {llama_cpp.__version__} ({built}), {args.threads} threads")
    t0 = time.perf_counter()
    llm = llama_cpp.Llama(
        str(path), n_ctx=args.prompt_tokens + args.new_tokens + 8, n_batch=max(args.prompt_tokens, 8),
        n_threads=args.threads, n_threads_batch=args.threads, verbose=False,
    )  # fmt: skip
    print(f"loaded in {time.perf_counter() - t0:.0f} s")
    prompt = list(range(300, 300 + args.prompt_tokens))

    def greedy() -> int:
        return int(np.argmax(np.ctypeslib.as_array(llm._ctx.get_logits(), shape=(llm.n_vocab(),))))

    decode = []
    for _ in range(args.repeats + 1):
        llm.reset()
        llm.eval(prompt)
        token = greedy()
        t0 = time.perf_counter()
        for _ in range(args.new_tokens):
            llm.eval([token])
            token = greedy()
        decode.append(args.new_tokens / (time.perf_counter() - t0))
    report("llama.cpp", decode[1:], args.prompt_tokens + args.new_tokens // 2, args.threads)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("what", choices=["write", "predict", "genfast", "llama"])
    p.add_argument("--out", type=Path, default=Path("/tmp/gpt-oss-20b-random.gguf"))
    p.add_argument("--gguf", type=Path, default=Path("/tmp/gpt-oss-20b-random.gguf"))
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--prompt-tokens", type=int, default=8)
    p.add_argument("--new-tokens", type=int, default=16)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--dtype", default="auto", help="genfast's --dtype for the non-expert weights")
    p.add_argument("--eager", action="store_true", help="genfast: no torch.compile")
    args = p.parse_args()
    sys.stdout.reconfigure(line_buffering=True)  # progress shows in a log file as it happens
    if args.what == "write":
        write(args.out)
    elif args.what == "predict":
        parts = bytes_per_token(args.prompt_tokens + args.new_tokens // 2)
        for name, n in parts.items():
            print(f"{name:>12}: {n / 1e9:.3f} GB")
        print(f"{'total':>12}: {sum(parts.values()) / 1e9:.3f} GB per token")
    elif args.what == "genfast":
        run_genfast(args.gguf, args)
    else:
        run_llama(args.gguf, args)


if __name__ == "__main__":
    main()
