"""Structured output: OpenAI's `response_format` as a grammar, and a token mask per decode step.

The grammar library is llguidance (Microsoft's; llama.cpp, vLLM and SGLang use it too). Of the
three considered (xgrammar, outlines-core), it has no dependencies (one abi3
wheel; xgrammar pulls in triton and transformers), compiles a JSON schema in milliseconds, where
outlines-core builds a regex index over the whole vocabulary per schema, and computes a mask in
tens of microseconds per token for SmolLM2's 49k-token vocabulary, small against a decode step.

The mask is applied to a row's logits after the compiled decode step, before sampling, so the
step's graph is the same with and without constraints (nothing recompiles), and log-probabilities
come from the masked distribution that was sampled.
"""

from __future__ import annotations

import json
from functools import cached_property, lru_cache
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor

from genfast.errors import UserError

if TYPE_CHECKING:
    from genfast.llm.checkpoints.tokenizer import Tokenizer

MISSING = "structured output needs the llguidance package: pip install 'genfast[serve]'"
# Replies are laid out as Python's json.dumps does (', ' and ': ', no other whitespace): fewer
# tokens than indented JSON, and no runs of whitespace for a small model to loop in. A schema's own
# "x-guidance" options override this.
JSON_LAYOUT = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


def _llguidance() -> Any:
    try:
        import llguidance
    except ImportError:
        raise UserError(MISSING) from None
    return llguidance


def response_format_grammar(response_format: dict[str, Any] | None) -> str | None:
    """The llguidance grammar for an OpenAI `response_format` (None: free text). Raises
    ValueError naming the field for a malformed one or a schema llguidance cannot compile."""
    if response_format is None:
        return None
    kind = response_format.get("type")
    if kind == "text":
        extra = set(response_format) - {"type"}
        if extra:
            raise ValueError(f"response_format of type text takes no other fields, got {sorted(extra)}")
        return None
    if kind == "json_object":
        schema: Any = {"type": "object"}
    elif kind == "json_schema":
        spec = response_format.get("json_schema")
        if not isinstance(spec, dict) or not isinstance(spec.get("name"), str):
            raise ValueError("response_format.json_schema must be an object with a name and a schema")
        unknown = set(spec) - {"name", "description", "schema", "strict"}
        if unknown:
            raise ValueError(f"response_format.json_schema has unknown fields {sorted(unknown)}")
        schema = spec.get("schema", {})
        if not isinstance(schema, dict):
            raise ValueError("response_format.json_schema.schema must be a JSON object")
    else:
        raise ValueError(f"response_format.type must be text, json_object or json_schema, got {kind!r}")
    return json_schema_grammar(schema, "response_format.json_schema.schema")


def json_schema_grammar(schema: dict[str, Any], field: str) -> str:
    """The llguidance grammar of a JSON schema; ValueError naming `field` if it cannot be used."""
    try:
        return _compiled_schema(json.dumps(schema))  # key order kept: it is the properties' order
    except ValueError as e:
        raise ValueError(f"{field} is not a usable JSON schema: {e}") from None


@lru_cache(maxsize=256)
def _compiled_schema(schema: str) -> str:
    """Compiled once per schema: a request's schema is checked when it is parsed and compiled
    again for its grammar, and clients send the same schemas over and over."""
    llguidance = _llguidance()
    grammar = llguidance.LLMatcher.grammar_from_json_schema(schema, defaults=JSON_LAYOUT)
    error = llguidance.LLMatcher.validate_grammar(grammar)
    if error:
        raise ValueError(error)
    return grammar


class Constraints:
    """One engine's constrained decoding: its tokenizer as llguidance sees it (built once, ~0.3 s
    for a 49k vocabulary) and a matcher per constrained request."""

    def __init__(self, tokenizer: Tokenizer, vocab_size: int) -> None:
        self.tokenizer, self.vocab_size = tokenizer, vocab_size

    @cached_property
    def _lltokenizer(self) -> Any:
        llguidance = _llguidance()
        stop = min(self.tokenizer.stop_ids) if self.tokenizer.stop_ids else None
        try:
            return llguidance.LLTokenizer(self.tokenizer.backend.to_str(), n_vocab=self.vocab_size, eos_token=stop)
        except ValueError as e:  # e.g. a decoder it cannot map tokens to bytes through
            raise UserError(f"structured output cannot use this model's tokenizer: {e}") from None

    def matcher(self, grammar: str) -> Matcher:
        return Matcher(_llguidance().LLMatcher(self._lltokenizer, grammar, log_level=0), self.vocab_size)


class Matcher:
    """Where one request is in its grammar: which tokens may come next, and what was taken."""

    def __init__(self, matcher: Any, vocab_size: int) -> None:
        if matcher.is_error():
            raise UserError(f"the grammar cannot be used with this model's tokenizer: {matcher.get_error()}")
        self._matcher, self.vocab_size = matcher, vocab_size
        self._words = torch.empty(1, (vocab_size + 31) // 32, dtype=torch.int32)
        self._bit = torch.arange(32, dtype=torch.int32)

    def allowed(self) -> Tensor:
        """bool [vocab_size] on the CPU: the tokens the grammar admits next."""
        self._matcher.unsafe_compute_mask_ptr(self._words.data_ptr(), self._words.numel() * 4)
        return ((self._words[0, :, None] >> self._bit) & 1).flatten()[: self.vocab_size].bool()

    def take(self, token: int) -> None:
        """Advance past a token sampled under `allowed()` (a token outside it is a bug)."""
        if not self._matcher.consume_token(token):
            raise RuntimeError(f"grammar rejected token {token}: {self._matcher.get_error()}")

    @property
    def complete(self) -> bool:
        """The grammar is finished: nothing but the end of the sequence may follow."""
        return self._matcher.is_stopped()
