"""Drafters for speculative decoding (genfast/llm/decoding/speculative.py): what proposes the k tokens.

- ModelDrafter: any model with the target's tokenizer (a smaller one, or an int4/int8 copy of the
  target), with its own KV cache, prefilled with the prompt and kept in step with the target.
- LayerDrafter: the target's own first N layers with its final norm and head (an early exit). It
  also shares the target's KV cache for those layers: layer i's keys and values at slot j depend
  only on the tokens up to j through layers < i, so the early exit computes exactly what the
  target writes there. Each verify pass rewrites slots [pos, pos+k] of every layer, so the
  draft's speculative writes never outlive a round, and the draft never needs a prefill or a
  catch-up step.
- PromptLookupDrafter: no model; proposes what followed the latest earlier occurrence of the
  last n tokens (prompt or generated text). q is one-hot, which the same acceptance rule handles.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from typing import Protocol

import torch
from torch import Tensor

from genfast.errors import UserError
from genfast.llm.checkpoints.tokenizer import Tokenizer
from genfast.llm.decoding.generate import Generator, positions
from genfast.llm.decoding.sampling import SamplingParams, draw, probabilities
from genfast.llm.loading import LoadedModel, load
from genfast.llm.model.transformer import Transformer

DRAFT_KINDS = "int4, int8, layers:N, prompt-lookup or model:PATH"


class DraftTarget(Protocol):
    """What a drafter reads of the generator it drafts for (genfast.llm.decoding.speculative's)."""

    model: Transformer
    tokenizer: Tokenizer
    device: torch.device
    k: int  # tokens drafted per round
    max_seq_len: int
    compiled: bool


class Drafter(ABC):
    """Proposes k tokens per round for a SpeculativeGenerator."""

    name = "draft"

    def attach(self, gen: DraftTarget) -> None:
        """Called once by the generator (check compatibility, allocate caches, compile)."""

    def start(self, prompt: Sequence[int], params: SamplingParams) -> None:
        """A new generation: the target has just prefilled `prompt`."""

    @abstractmethod
    def propose(self, history: list[int], params: SamplingParams) -> tuple[Tensor, Tensor] | None:
        """Draft tokens [k] and the distributions [k, V] they were drawn from, to follow
        `history` (prompt and generated tokens; the last one, at slot len(history) - 1, is not yet
        in the target's cache). None: no proposal this round (the target takes a plain step)."""

    def commit(self, valid: int) -> None:
        """After a round: cache slots below `valid` hold the tokens of the accepted history."""


class _DraftSteps(Generator):
    """A Generator over the draft model whose steps also return q, the draft's distribution
    (the same `probabilities` the target's verify applies), optionally exiting after n_layers."""

    def __init__(
        self, model: Transformer, tokenizer: Tokenizer, max_seq_len: int, compile: bool, n_layers: int | None
    ) -> None:
        self.n_layers = n_layers
        super().__init__(model, tokenizer, max_seq_len=max_seq_len, max_batch_size=1, compile=compile)

    # Two functions, as in Generator: dynamo caches graphs per code object.
    def _prefill_step(
        self,
        tokens: Tensor,
        input_pos: Tensor,
        mask: Tensor,  # type: ignore[override]
        params: SamplingParams,
    ) -> tuple[Tensor, Tensor]:
        q = probabilities(self.model(tokens, input_pos, mask, n_layers=self.n_layers), params)
        return draw(q), q

    def _decode_step(
        self,
        tokens: Tensor,
        input_pos: Tensor,
        mask: Tensor,  # type: ignore[override]
        params: SamplingParams,
    ) -> tuple[Tensor, Tensor]:
        q = probabilities(self.model(tokens, input_pos, mask, n_layers=self.n_layers), params)
        return draw(q), q


class ModelDrafter(Drafter):
    """Drafts with a separate model that shares the target's tokenizer, with its own KV cache.

    The draft's cache holds correct tokens below `_seen`. A round feeds it what it has not seen
    (the pending token; after a fully accepted round also the last draft), then its own k-1
    drafts; slots of rejected drafts are overwritten by later rounds.
    """

    name = "draft model"

    def __init__(self, model: Transformer, n_layers: int | None = None) -> None:
        self.model, self.n_layers = model, n_layers
        self._seen = self._fed = self._calls = 0

    def attach(self, gen: DraftTarget) -> None:
        vocab, want = self.model.args.vocab_size, gen.model.args.vocab_size
        if vocab != want:
            raise UserError(
                f"the draft model's vocabulary has {vocab} tokens and the target's {want}; "
                "use a draft model with the target's tokenizer"
            )
        self.k = gen.k
        self.steps = _DraftSteps(self.model, gen.tokenizer, gen.max_seq_len, gen.compiled, self.n_layers)
        if self.steps.max_seq_len < gen.max_seq_len:
            raise UserError(
                f"the draft model's context ({self.steps.max_seq_len} tokens) is shorter than the "
                f"target's cache ({gen.max_seq_len}); lower --max-seq-len"
            )

    def start(self, prompt: Sequence[int], params: SamplingParams) -> None:
        self._calls = 0
        self.steps._prefill_prompts([prompt], params)
        self._seen = self._fed = len(prompt)

    def propose(self, history: list[int], params: SamplingParams) -> tuple[Tensor, Tensor]:
        device = self.steps.device
        pending = torch.tensor(history[self._seen :], device=device)
        tokens, dists = [], []
        for i in range(len(pending) + self.k - 1):
            tok = pending[i] if i < len(pending) else tokens[-1]
            input_pos, mask = positions(self.steps, self._seen + i, 1)
            drafted, q = self.steps._step(tok.view(1, 1), input_pos, mask, params, steady=self._calls > 0)
            self._calls += 1
            if i >= len(pending) - 1:  # outputs before the pending token only fill the cache
                tokens.append(drafted[0])
                dists.append(q[0])
        self._fed = self._seen + len(pending) + self.k - 1
        return torch.stack(tokens), torch.stack(dists)

    def commit(self, valid: int) -> None:
        self._seen = min(self._fed, valid)


class LayerDrafter(ModelDrafter):
    """The target's first `n_layers` layers with its final norm and head, sharing its weights and
    its KV cache for those layers (see the module docstring): no prefill, no catch-up."""

    def __init__(self, n_layers: int) -> None:
        self.n_layers = n_layers
        self.name = f"first {n_layers} layers"
        self._seen = self._fed = self._calls = 0

    def attach(self, gen: DraftTarget) -> None:
        total = gen.model.args.n_layers
        if not 1 <= self.n_layers < total:
            raise UserError(
                f"--self-draft layers:N needs 1 <= N < {total} (the model's layer count), got {self.n_layers}"
            )
        self.model = gen.model
        super().attach(gen)

    def start(self, prompt: Sequence[int], params: SamplingParams) -> None:
        self._calls, self._seen = 0, len(prompt)  # the target's prefill filled the shared cache

    def commit(self, valid: int) -> None:
        self._seen = valid  # the target's verify pass wrote every slot below `valid`


class PromptLookupDrafter(Drafter):
    """Proposes the k tokens that followed the latest earlier occurrence of the history's last
    n tokens (n from max_ngram down to min_ngram); no proposal without a match."""

    name = "prompt lookup"

    def __init__(self, max_ngram: int = 3, min_ngram: int = 1) -> None:
        if not 1 <= min_ngram <= max_ngram:
            raise ValueError(f"need 1 <= min_ngram <= max_ngram, got {min_ngram}, {max_ngram}")
        self.max_ngram, self.min_ngram = max_ngram, min_ngram
        self._ends: list[dict[tuple[int, ...], int]] = []
        self._indexed = 0

    def attach(self, gen: DraftTarget) -> None:
        self.k, self.vocab, self.device = gen.k, gen.model.args.vocab_size, gen.device

    def start(self, prompt: Sequence[int], params: SamplingParams) -> None:
        self._ends = [{} for _ in range(self.max_ngram + 1)]  # n -> n-gram -> latest slot after it
        self._indexed = 0

    def propose(self, history: list[int], params: SamplingParams) -> tuple[Tensor, Tensor] | None:
        # Index n-grams ending before the last token (history only grows): O(new tokens) a round.
        for end in range(self._indexed, len(history)):
            for n in range(1, min(self.max_ngram, end) + 1):
                self._ends[n][tuple(history[end - n : end])] = end
        self._indexed = len(history)
        for n in range(min(self.max_ngram, len(history)), self.min_ngram - 1, -1):
            end = self._ends[n].get(tuple(history[-n:]))
            if end is not None:
                draft = history[end : end + self.k]
                draft += draft[-1:] * (self.k - len(draft))  # padding only costs a rejection
                tokens = torch.tensor(draft, device=self.device)
                return tokens, torch.zeros(self.k, self.vocab, device=self.device).scatter_(1, tokens[:, None], 1.0)
        return None


def parse_draft(spec: str) -> tuple[str, str | int | None]:
    """'int4' | 'int8' | 'layers:N' | 'prompt-lookup' | 'model:PATH' -> (kind, argument)."""
    kind, _, arg = spec.partition(":")
    if kind in ("int4", "int8", "prompt-lookup") and not arg:
        return kind, None
    if kind == "layers":
        try:
            return kind, int(arg)
        except ValueError:
            raise UserError(f"--self-draft layers:N needs a whole number of layers, got {arg!r}") from None
    if kind == "model" and arg:
        return kind, arg
    raise UserError(f"unknown draft {spec!r}; use {DRAFT_KINDS}")


def make_drafter(spec: str, loaded: LoadedModel) -> Drafter:
    """The drafter `spec` (see parse_draft) names for the loaded target model."""
    kind, arg = parse_draft(spec)
    if kind == "prompt-lookup":
        return PromptLookupDrafter()
    if kind == "layers":
        assert isinstance(arg, int)
        return LayerDrafter(arg)
    dtype = str(loaded.dtype).removeprefix("torch.")
    if kind == "model":
        draft = load(str(arg), str(loaded.device), dtype)
        probe = "Speculative decoding needs the same tokenizer: 123 éß <|im_end|>"
        if draft.tokenizer.encode(probe) != loaded.tokenizer.encode(probe):
            raise UserError(
                f"the draft model {draft.path} tokenizes text differently from the target; "
                "use a draft model with the target's tokenizer"
            )
        drafter = ModelDrafter(draft.model)
        drafter.name = f"draft {draft.path.name}"
        return drafter
    if loaded.quant != "none":
        raise UserError(
            f"--self-draft {kind} quantizes the target's weights, which are already {loaded.quant}; "
            "use --self-draft layers:N or --prompt-lookup"
        )
    draft = load(loaded.checkpoint, str(loaded.device), dtype, quant=kind)
    drafter = ModelDrafter(draft.model)
    drafter.name = f"{draft.quant} copy"
    return drafter
