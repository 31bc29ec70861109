"""Speculative decoding: a cheap drafter proposes k tokens, the target checks them in one pass.

Each round the target runs once over k+1 tokens (the pending token and the k drafts) at cache
slots [pos, pos+k] and keeps the longest acceptable prefix of the drafts plus one token of its own,
so a round yields 1 to k+1 tokens for one pass over the target's weights (Leviathan et al. 2023,
Chen et al. 2023). The output is the target's: token for token with greedy decoding, and in
distribution when sampling (`accept_drafts`).

Drafters:
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

KV caches: slots past the accepted prefix hold rejected tokens' keys and values; they are never
read (the causal mask stops at each query's position) and the next round overwrites them.
"""

from __future__ import annotations

import time
from abc import ABC, abstractmethod
from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch
from torch import Tensor

from genfast.compile import compile_fn
from genfast.errors import UserError
from genfast.hardware import synchronize
from genfast.llm.generate import Completions, GenerationResult, Generator, TextCallback
from genfast.llm.model import Transformer, attention_mask
from genfast.llm.sampling import SamplingParams, draw, probabilities
from genfast.llm.tokenizer import Tokenizer

if TYPE_CHECKING:
    from genfast.llm.session import LoadedModel

DEFAULT_K = 4
MAX_K = 16
DRAFT_KINDS = "int4, int8, layers:N, prompt-lookup or model:PATH"


def accept_drafts(p: Tensor, q: Tensor, draft: Tensor) -> tuple[Tensor, Tensor]:
    """The speculative sampling rule for one sequence; returns (accepted count n, next token).

    p: the target's distributions [k+1, V] at the pending token and after each draft token;
    q: the draft's [k, V], from which `draft` [k] was drawn. Draft token i is accepted with
    probability min(1, p_i(x)/q_i(x)); at the first rejection the next token is drawn from
    max(0, p_i - q_i) (renormalized), and after k acceptances from p_k (a bonus token). Every
    token produced is then distributed as the target's own draw. With greedy one-hot p and q this
    accepts exactly the drafts equal to the target's argmax and returns the argmax after them.
    """
    k = draft.shape[0]
    rows = torch.arange(k, device=draft.device)
    p_x, q_x = p[rows, draft], q[rows, draft]
    accepted = torch.rand(k, device=draft.device) * q_x < p_x  # u < p/q, no division (q_x > 0)
    n = accepted.int().cumprod(0).sum()
    q_next = torch.cat([q, torch.zeros_like(q[:1])])  # after k acceptances the residual is p_k itself
    at_n = n.view(1).long()  # a tensor index, not a Python int: no host sync, no recompiles
    p_n = p.index_select(0, at_n)
    residual = (p_n - q_next.index_select(0, at_n)).clamp_min(0)
    # Rounding can leave no mass where p and q nearly agree; p is then the right distribution.
    residual = torch.where(residual.sum() > 0, residual, p_n)
    return n, draw(residual)[0]


def positions(gen: Generator, start: int, n: int) -> tuple[Tensor, Tensor]:
    """Slots [start, start+n) and their causal mask over the valid cache (on CUDA the whole
    cache, so shapes stay static for CUDA graphs)."""
    input_pos = torch.arange(start, start + n, device=gen.device)
    return input_pos, attention_mask(input_pos, gen.max_seq_len if gen.static_kv else start + n)


class Drafter(ABC):
    """Proposes k tokens per round for a SpeculativeGenerator."""

    name = "draft"

    def attach(self, gen: SpeculativeGenerator) -> None:
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

    def __init__(self, model: Transformer, tokenizer: Tokenizer, max_seq_len: int, compile: bool,
                 n_layers: int | None) -> None:
        self.n_layers = n_layers
        super().__init__(model, tokenizer, max_seq_len=max_seq_len, max_batch_size=1, compile=compile)

    # Two functions, as in Generator: dynamo caches graphs per code object.
    def _prefill_step(self, tokens: Tensor, input_pos: Tensor, mask: Tensor,  # type: ignore[override]
                      params: SamplingParams) -> tuple[Tensor, Tensor]:
        q = probabilities(self.model(tokens, input_pos, mask, n_layers=self.n_layers), params)
        return draw(q), q

    def _decode_step(self, tokens: Tensor, input_pos: Tensor, mask: Tensor,  # type: ignore[override]
                     params: SamplingParams) -> tuple[Tensor, Tensor]:
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

    def attach(self, gen: SpeculativeGenerator) -> None:
        vocab, want = self.model.args.vocab_size, gen.model.args.vocab_size
        if vocab != want:
            raise UserError(f"the draft model's vocabulary has {vocab} tokens and the target's {want}; "
                            "use a draft model with the target's tokenizer")
        self.k = gen.k
        self.steps = _DraftSteps(self.model, gen.tokenizer, gen.max_seq_len, gen.compiled, self.n_layers)
        if self.steps.max_seq_len < gen.max_seq_len:
            raise UserError(f"the draft model's context ({self.steps.max_seq_len} tokens) is shorter than the "
                            f"target's cache ({gen.max_seq_len}); lower --max-seq-len")

    def start(self, prompt: Sequence[int], params: SamplingParams) -> None:
        self._calls = 0
        self.steps._prefill_prompts([prompt], params)
        self._seen = self._fed = len(prompt)

    def propose(self, history: list[int], params: SamplingParams) -> tuple[Tensor, Tensor]:
        device = self.steps.device
        pending = torch.tensor(history[self._seen:], device=device)
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

    def attach(self, gen: SpeculativeGenerator) -> None:
        total = gen.model.args.n_layers
        if not 1 <= self.n_layers < total:
            raise UserError(f"--self-draft layers:N needs 1 <= N < {total} (the model's layer count), "
                            f"got {self.n_layers}")
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

    def attach(self, gen: SpeculativeGenerator) -> None:
        self.k, self.vocab, self.device = gen.k, gen.model.args.vocab_size, gen.device

    def start(self, prompt: Sequence[int], params: SamplingParams) -> None:
        self._ends = [{} for _ in range(self.max_ngram + 1)]  # n -> n-gram -> latest slot after it
        self._indexed = 0

    def propose(self, history: list[int], params: SamplingParams) -> tuple[Tensor, Tensor] | None:
        # Index n-grams ending before the last token (history only grows): O(new tokens) a round.
        for end in range(self._indexed, len(history)):
            for n in range(1, min(self.max_ngram, end) + 1):
                self._ends[n][tuple(history[end - n:end])] = end
        self._indexed = len(history)
        for n in range(min(self.max_ngram, len(history)), self.min_ngram - 1, -1):
            end = self._ends[n].get(tuple(history[-n:]))
            if end is not None:
                draft = history[end:end + self.k]
                draft += draft[-1:] * (self.k - len(draft))  # padding only costs a rejection
                tokens = torch.tensor(draft, device=self.device)
                return tokens, torch.zeros(self.k, self.vocab, device=self.device).scatter_(1, tokens[:, None], 1.0)
        return None


class SpeculativeGenerator(Generator):
    """Generator whose decode drafts k tokens and verifies them in one target pass (batch 1).

    Prefill, the plain decode step (used when the drafter has no proposal or fewer than k+1
    cache slots remain) and their compilation are Generator's; the verify step is compiled
    alongside (k+1 tokens: a static shape; the valid cache length is dynamic, as in decode).
    """

    def __init__(self, model: Transformer, tokenizer: Tokenizer, drafter: Drafter, k: int = DEFAULT_K,
                 max_seq_len: int | None = None, compile: bool = True) -> None:
        if not 1 <= k <= MAX_K:
            raise UserError(f"--speculate-k must be between 1 and {MAX_K}, got {k}")
        super().__init__(model, tokenizer, max_seq_len=max_seq_len, max_batch_size=1, compile=compile)
        self.k, self.drafter = k, drafter
        if compile:
            self._verify = compile_fn(self._verify_step, self.device, decode=True, model=model)
        drafter.attach(self)

    def _verify_step(self, tokens: Tensor, input_pos: Tensor, mask: Tensor, q: Tensor,
                     params: SamplingParams) -> Tensor:
        """The target over [pending, drafts] and the acceptance rule, in one graph; returns
        [k+2]: the drafts, the next token, the number of drafts accepted (one host sync)."""
        p = probabilities(self.model(tokens, input_pos, mask, all_logits=True)[0], params)
        drafts = tokens[0, 1:]
        n, next_token = accept_drafts(p, q, drafts)
        return torch.cat([drafts, next_token.view(1), n.view(1)])

    def _run_verify(self, tokens: Tensor, input_pos: Tensor, mask: Tensor, q: Tensor,
                    params: SamplingParams, steady: bool) -> Tensor:
        if not self.compiled:
            return self._verify_step(tokens, input_pos, mask, q, params)
        if not self.static_kv:
            torch._dynamo.mark_dynamic(mask, 3)  # the valid cache length
        return self._run_compiled(self._verify, steady, tokens, input_pos, mask, q, params)

    @torch.inference_mode()
    def generate(self, prompts: Sequence[Sequence[int]], max_new_tokens: int,
                 params: SamplingParams = SamplingParams(), stop_strings: Sequence[str] = (),
                 seed: int | None = None, on_text: TextCallback | None = None,
                 stop_at_eos: bool = True) -> GenerationResult:
        """As Generator.generate, for one prompt; the result also carries acceptance stats."""
        if len(prompts) != 1:
            raise UserError(f"speculative decoding runs one prompt at a time; got {len(prompts)}")
        lengths = self._check_request(prompts, max_new_tokens)
        if seed is not None:
            torch.manual_seed(seed)
        out = Completions(self.tokenizer, 1, stop_strings, stop_at_eos, on_text)
        first, _, prefill_s = self._prefill_prompts(prompts, params)
        history = [*prompts[0], first.item()]
        out.push(0, history[-1])
        self.drafter.start(prompts[0], params)

        end = lengths[0] + max_new_tokens  # history length when done
        decode_s, draft_s, produced, verifies, plain, accepted, kv_total = 0.0, 0.0, 0, 0, 0, 0, 0
        while not out.done[0] and len(history) < end:
            t0 = time.perf_counter()
            pos = len(history) - 1  # the pending token's slot
            proposal = self.drafter.propose(history, params) if pos + self.k < self.max_seq_len else None
            synchronize(self.device)
            draft_s += time.perf_counter() - t0
            if proposal is None:
                input_pos, mask = positions(self, pos, 1)
                tokens = torch.tensor([[history[-1]]], device=self.device)
                new, n = self._step(tokens, input_pos, mask, params, steady=plain > 0).tolist(), 0
                plain += 1
            else:
                drafts, q = proposal
                tokens = torch.cat([torch.tensor([history[-1]], device=self.device), drafts])[None]
                input_pos, mask = positions(self, pos, self.k + 1)
                result = self._run_verify(tokens, input_pos, mask, q, params, steady=verifies > 0).tolist()
                n = result[-1]
                new = result[:n] + [result[self.k]]
                verifies += 1
                accepted += n
            self.drafter.commit(pos + n + 1)
            kv_total += pos + len(new)
            new = new[:end - len(history)]
            history += new
            decode_s += time.perf_counter() - t0
            for tok in new:
                if out.done[0]:
                    break
                out.push(0, tok)
                produced += 1

        passes = verifies + plain
        return out.finish(prompt_tokens=lengths[0], prefill_s=prefill_s, decode_s=decode_s, decode_steps=produced,
                          mean_kv_len=kv_total / passes if passes else 0.0, speculate_k=self.k,
                          drafted_tokens=verifies * self.k, accepted_tokens=accepted, target_passes=passes,
                          draft_s=draft_s)

    @torch.inference_mode()  # as in generate(): grad mode is part of the compiled graphs' guards
    def warmup(self, params: SamplingParams = SamplingParams()) -> float:
        """Compile prefill, the plain decode step, the verify step and the drafter's steps."""
        t0 = time.perf_counter()
        bos = self.tokenizer.bos_id or 0
        self.generate([[bos] * 2], max_new_tokens=self.k + 2, params=params, stop_at_eos=False)
        # Both target steps, whichever the drafter's proposals used above. Their cache writes at
        # slots 1.. are overwritten by the next prefill or before they are read.
        input_pos, mask = positions(self, 1, 1)  # two valid slots: a one-slot mask would specialize
        self._step(torch.zeros(1, 1, dtype=torch.long, device=self.device), input_pos, mask, params)
        input_pos, mask = positions(self, 1, self.k + 1)
        q = torch.full((self.k, self.model.args.vocab_size), 1.0 / self.model.args.vocab_size, device=self.device)
        self._run_verify(torch.zeros(1, self.k + 1, dtype=torch.long, device=self.device), input_pos, mask, q,
                         params, steady=False)
        return time.perf_counter() - t0


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
    from genfast.llm.session import load

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
            raise UserError(f"the draft model {draft.path} tokenizes text differently from the target; "
                            "use a draft model with the target's tokenizer")
        drafter = ModelDrafter(draft.model)
        drafter.name = f"draft {draft.path.name}"
        return drafter
    if loaded.quant != "none":
        raise UserError(f"--self-draft {kind} quantizes the target's weights, which are already {loaded.quant}; "
                        "use --self-draft layers:N or --prompt-lookup")
    draft = load(str(loaded.path), str(loaded.device), dtype, quant=kind)
    drafter = ModelDrafter(draft.model)
    drafter.name = f"{draft.quant} copy"
    return drafter
