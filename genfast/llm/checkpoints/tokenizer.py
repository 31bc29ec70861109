"""Tokenizers (via the `tokenizers` library) and chat templates, from HF directories or GGUF files.

A GGUF file carries its vocabulary, merges and a `tokenizer.ggml.pre` name; llama.cpp maps that
name to a list of pre-tokenizer regexes. We rebuild the same pipeline as a `tokenizers` object, so
a GGUF model tokenizes exactly like its source tokenizer (for SmolLM2: digits split one by one).
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from dataclasses import dataclass, field
from datetime import datetime
from functools import cache
from pathlib import Path
from typing import TYPE_CHECKING, Any

from genfast.errors import UserError
from genfast.llm import harmony
from genfast.llm.checkpoints.checkpoint import read_json

if TYPE_CHECKING:
    from genfast.llm.checkpoints.checkpoint import Checkpoint

# GPT-2's pre-tokenizer regex (with the trailing `\s+` branch llama.cpp's splitter also applies).
_GPT2 = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"
_LLAMA3 = (
    r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2 = _LLAMA3.replace(r"\p{N}{1,3}", r"\p{N}")
# o200k (gpt-4o, gpt-oss): words split where lower case turns to upper, contractions kept on.
_CASED_WORD = r"[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]"
_LOWER_WORD = r"[\p{Ll}\p{Lm}\p{Lo}\p{M}]"
_CONTRACTION = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
_O200K = (
    rf"[^\r\n\p{{L}}\p{{N}}]?{_CASED_WORD}*{_LOWER_WORD}+{_CONTRACTION}"
    rf"|[^\r\n\p{{L}}\p{{N}}]?{_CASED_WORD}+{_LOWER_WORD}*{_CONTRACTION}"
    r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
# `tokenizer.ggml.pre` -> (regexes applied in turn, whole pieces kept as-is when in the vocab).
_GGUF_PRE_TOKENIZERS: dict[str, tuple[list[str], bool]] = {
    "gpt-2": ([_GPT2], False),
    "phi-2": ([_GPT2], False),
    "olmo": ([_GPT2], False),
    "mpt": ([_GPT2], False),
    "smollm": ([r"\p{N}", _GPT2], False),
    "starcoder": ([r"\p{N}", _GPT2], False),
    "refact": ([r"\p{N}", _GPT2], False),
    "command-r": ([r"\p{N}", _GPT2], False),
    "llama-bpe": ([_LLAMA3], True),
    "llama3": ([_LLAMA3], True),
    "dbrx": ([_LLAMA3], False),
    "smaug-bpe": ([_LLAMA3], False),
    "qwen2": ([_QWEN2], False),
    "gpt-4o": ([_O200K], False),
    "stablelm2": ([_QWEN2], False),
    "default": ([r"[\p{P}\$\+<=>\^~\|]+", _GPT2, r"\p{N}+", r"[0-9][0-9][0-9]"], False),
}
# llama.cpp's BPE vocabularies add BOS by default only for these pre-tokenizers.
_GGUF_BOS_BY_DEFAULT = {"llama-bpe", "llama3"}
# GGUF token types.
_CONTROL, _USER_DEFINED = 3, 4
# Tokens that end a turn in common chat formats; generation stops at them when present.
_END_OF_TURN_TEXTS = ("<|im_end|>", "<|eot_id|>", "<|eom_id|>", "<|endoftext|>", "</s>", "<|end|>")


@dataclass
class Tokenizer:
    """A `tokenizers.Tokenizer` plus what generation needs: BOS handling, stop ids, chat template."""

    backend: Any  # tokenizers.Tokenizer
    bos_id: int | None = None
    add_bos: bool = False
    stop_ids: set[int] = field(default_factory=set)
    chat_template: str | None = None
    bos_token: str = ""
    eos_token: str = ""
    # OpenAI's harmony format (gpt-oss; genfast.llm.harmony): set from the vocabulary. Its decoded
    # text keeps the special tokens, which mark the reply's messages and channels.
    harmony: bool = field(init=False, default=False)

    def __post_init__(self) -> None:
        ids = {marker: self.backend.token_to_id(marker) for marker in harmony.MARKERS}
        self.harmony = all(ids[m] is not None for m in (harmony.CHANNEL, harmony.MESSAGE, harmony.RETURN))
        if self.harmony:
            # <|end|> ends a message within a reply (the analysis before the answer), whatever a
            # config lists; <|return|> and <|call|> end the reply.
            ends = {ids[m] for m in harmony.STOP_TEXTS if ids[m] is not None}
            self.stop_ids = (set(self.stop_ids) - {ids[harmony.END]}) | ends

    @property
    def vocab_size(self) -> int:
        return self.backend.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str, add_bos: bool | None = None) -> list[int]:
        """Token ids of `text`; special-token text (e.g. `<|im_start|>`) becomes its special id."""
        ids = self.backend.encode(text, add_special_tokens=False).ids
        add = self.add_bos if add_bos is None else add_bos
        if add and self.bos_id is not None and (not ids or ids[0] != self.bos_id):
            ids = [self.bos_id] + ids
        return ids

    def decode(self, ids: Iterable[int], skip_special: bool | None = None) -> str:
        """Text of `ids`, without special tokens unless `skip_special` is False (default: kept
        by harmony tokenizers only)."""
        skip = not self.harmony if skip_special is None else skip_special
        return self.backend.decode(list(ids), skip_special_tokens=skip)

    def save(self, directory: Path) -> None:
        """Write tokenizer.json and the configs `load_tokenizer` reads back into an equal Tokenizer."""
        self.backend.save(str(directory / "tokenizer.json"))
        config = {
            "bos_token": self.bos_token,
            "eos_token": self.eos_token,
            "add_bos_token": self.add_bos,
            "chat_template": self.chat_template,
        }
        (directory / "tokenizer_config.json").write_text(json.dumps(config, indent=1, ensure_ascii=False))
        generation = {"bos_token_id": self.bos_id, "eos_token_id": sorted(self.stop_ids)}
        (directory / "generation_config.json").write_text(json.dumps(generation, indent=1))

    def apply_chat_template(
        self, messages: list[dict[str, Any]], add_generation_prompt: bool = True, tools: list[dict] | None = None
    ) -> str:
        """Render a conversation with the model's own (jinja) template; `tools` (OpenAI's function
        definitions) go to templates that take them as their `tools` variable."""
        if not self.chat_template:
            raise UserError("this model has no chat template; use `genfast generate` with a plain prompt")
        return render_chat_template(
            self.chat_template,
            messages,
            add_generation_prompt,
            tools=tools,
            bos_token=self.bos_token,
            eos_token=self.eos_token,
        )

    @property
    def template_takes_tools(self) -> bool:
        """Whether the chat template renders a `tools` variable (Qwen, Llama 3.1+, Hermes-style ones)."""
        return bool(self.chat_template) and "tools" in self.chat_template


def render_chat_template(
    template: str, messages: list[dict[str, Any]], add_generation_prompt: bool, **variables: Any
) -> str:
    """Render with the same jinja settings transformers uses, in a sandbox."""
    import jinja2
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message: str) -> None:
        raise UserError(f"chat template error: {message}")

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"])
    env.filters["tojson"] = lambda x, indent=None, **_: json.dumps(x, ensure_ascii=False, indent=indent)
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    try:
        return env.from_string(template).render(
            messages=messages, add_generation_prompt=add_generation_prompt, **variables
        )
    except jinja2.TemplateError as e:
        raise UserError(f"the model's chat template failed to render: {e}") from e


@cache
def pydoc_tokenizer() -> Tokenizer:
    """A byte-level BPE trained on Python's pydoc topics (~9,200 tokens, ~0.2 s to train; the
    same every time), for models with random weights (genfast.llm.checkpoints.random_model): prompts encode
    as text does. No end-of-sequence token."""
    from tokenizers import Tokenizer as Backend
    from tokenizers import decoders, models, pre_tokenizers, trainers

    from genfast.llm.corpus import pydoc_text

    backend = Backend(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=32000, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False
    )
    backend.train_from_iterator([pydoc_text()], trainer)
    return Tokenizer(backend, bos_id=None, add_bos=False, stop_ids=set())


def load_tokenizer(checkpoint: Checkpoint) -> Tokenizer:
    """A checkpoint's tokenizer: from a HF or `genfast quantize` directory (tokenizer.json), from a
    GGUF file's metadata, or for random weights `pydoc_tokenizer`."""
    if checkpoint.format == "random":
        return pydoc_tokenizer()
    if checkpoint.format in ("hf", "genfast"):
        return _hf_tokenizer(checkpoint.path)
    return gguf_tokenizer(checkpoint.gguf.metadata)


def _hf_tokenizer(path: Path) -> Tokenizer:
    from tokenizers import Tokenizer as Backend

    tok_file = path / "tokenizer.json"
    if not tok_file.is_file():
        raise UserError(f"{path} has no tokenizer.json (genfast reads fast-tokenizer files only)")
    try:
        backend = Backend.from_file(str(tok_file))
    except Exception as exc:  # tokenizers raises plain Exceptions for unreadable files
        raise UserError(f"cannot read {tok_file} (truncated or not a tokenizer.json?): {exc}") from exc
    config = _json_or_empty(path / "tokenizer_config.json")
    gen_config = _json_or_empty(path / "generation_config.json")

    def token_text(value: Any) -> str:
        return value.get("content", "") if isinstance(value, dict) else (value or "")

    bos, eos = token_text(config.get("bos_token")), token_text(config.get("eos_token"))
    bos_id = backend.token_to_id(bos) if bos else gen_config.get("bos_token_id")
    stop_ids = _as_set(gen_config.get("eos_token_id"))
    if eos and backend.token_to_id(eos) is not None:
        stop_ids.add(backend.token_to_id(eos))
    template = config.get("chat_template")
    if isinstance(template, list):  # named templates: use the default one
        template = next((t["template"] for t in template if t.get("name") == "default"), None)
    for name in ("chat_template.jinja", "chat_template.json"):
        if template is None and (path / name).is_file():
            text = (path / name).read_text()
            template = json.loads(text)["chat_template"] if name.endswith(".json") else text
    # Llama/Mistral-style tokenizer.json files add BOS in their post-processor; others don't.
    probe = backend.encode("a", add_special_tokens=True).ids
    add_bos = bool(config.get("add_bos_token", bos_id is not None and probe[:1] == [bos_id]))
    return Tokenizer(backend, bos_id, add_bos, stop_ids | _end_of_turn_ids(backend), template, bos, eos)


def gguf_tokenizer(meta: dict[str, Any]) -> Tokenizer:
    """Build the `tokenizers` pipeline llama.cpp would use for this GGUF vocabulary."""
    from tokenizers import AddedToken, Regex, decoders, models, normalizers, pre_tokenizers
    from tokenizers import Tokenizer as Backend

    kind = meta.get("tokenizer.ggml.model")
    tokens: list[str] = meta.get("tokenizer.ggml.tokens") or []
    if not tokens:
        raise UserError("the GGUF file has no tokenizer vocabulary (tokenizer.ggml.tokens)")
    types: list[int] = meta.get("tokenizer.ggml.token_type") or [1] * len(tokens)
    vocab = {t: i for i, t in enumerate(tokens)}

    if kind == "gpt2":
        pre = meta.get("tokenizer.ggml.pre") or "default"
        if pre not in _GGUF_PRE_TOKENIZERS:
            raise UserError(f"unsupported GGUF pre-tokenizer {pre!r}; known: {', '.join(sorted(_GGUF_PRE_TOKENIZERS))}")
        regexes, ignore_merges = _GGUF_PRE_TOKENIZERS[pre]
        merges = [tuple(m.split(" ", 1)) for m in meta.get("tokenizer.ggml.merges") or []]
        backend = Backend(models.BPE(vocab, merges, ignore_merges=ignore_merges))
        backend.pre_tokenizer = pre_tokenizers.Sequence(
            [pre_tokenizers.Split(Regex(r), behavior="isolated") for r in regexes]
            + [pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)]
        )
        backend.decoder = decoders.ByteLevel()
        add_bos_default = pre in _GGUF_BOS_BY_DEFAULT
    elif kind == "llama":
        scores: list[float] = meta.get("tokenizer.ggml.scores") or [0.0] * len(tokens)
        backend = Backend(
            models.BPE(
                vocab,
                _merges_from_scores(tokens, scores),
                byte_fallback=True,
                fuse_unk=True,
                unk_token=tokens[int(meta.get("tokenizer.ggml.unknown_token_id", 0))],
            )
        )
        steps = [normalizers.Replace(" ", "\u2581")]
        if meta.get("tokenizer.ggml.add_space_prefix", True):
            steps.insert(0, normalizers.Prepend("\u2581"))
        backend.normalizer = normalizers.Sequence(steps)
        backend.decoder = decoders.Sequence(
            [
                decoders.Replace("\u2581", " "),
                decoders.ByteFallback(),
                decoders.Fuse(),
                decoders.Strip(" ", 1, 0),
            ]
        )
        add_bos_default = True
    else:
        raise UserError(
            f"unsupported GGUF tokenizer model {kind!r}; genfast reads 'gpt2' (BPE) and 'llama' (SentencePiece)"
        )

    backend.add_special_tokens(
        [AddedToken(tokens[i], special=True, normalized=False) for i, t in enumerate(types) if t == _CONTROL]
    )
    backend.add_tokens(
        [AddedToken(tokens[i], special=False, normalized=False) for i, t in enumerate(types) if t == _USER_DEFINED]
    )
    bos_id = meta.get("tokenizer.ggml.bos_token_id")
    stop_ids = {
        meta[k]
        for k in ("tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id", "tokenizer.ggml.eom_token_id")
        if k in meta
    }
    add_bos = bool(meta.get("tokenizer.ggml.add_bos_token", add_bos_default))
    return Tokenizer(
        backend,
        bos_id,
        add_bos and bos_id is not None,
        stop_ids | _end_of_turn_ids(backend),
        meta.get("tokenizer.chat_template"),
        tokens[bos_id] if bos_id is not None else "",
        tokens[meta["tokenizer.ggml.eos_token_id"]] if "tokenizer.ggml.eos_token_id" in meta else "",
    )


def _merges_from_scores(tokens: list[str], scores: list[float]) -> list[tuple[str, str]]:
    """BPE merges equivalent to SentencePiece's score-ordered merging: every split of a piece into
    two known pieces, ordered by the merged piece's score (highest first)."""
    vocab = set(tokens)
    ranked = []
    for piece, score in zip(tokens, scores):
        for cut in range(1, len(piece)):
            left, right = piece[:cut], piece[cut:]
            if left in vocab and right in vocab:
                ranked.append((-score, left, right))
    ranked.sort(key=lambda r: r[0])
    return [(left, right) for _, left, right in ranked]


def _end_of_turn_ids(backend: Any) -> set[int]:
    ids = {backend.token_to_id(t) for t in _END_OF_TURN_TEXTS}
    return {i for i in ids if i is not None}


def _json_or_empty(path: Path) -> dict[str, Any]:
    return read_json(path) if path.is_file() else {}


def _as_set(value: Any) -> set[int]:
    if value is None:
        return set()
    return set(value) if isinstance(value, list) else {int(value)}
