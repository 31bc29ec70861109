"""Speculative decoding: a cheap drafter proposes k tokens, the target checks them in one pass.

Each round the target runs once over k+1 tokens (the pending token and the k drafts) at cache
slots [pos, pos+k] and keeps the longest acceptable prefix of the drafts plus one token of its own,
so a round yields 1 to k+1 tokens for one pass over the target's weights (Leviathan et al. 2023,
Chen et al. 2023). The output is the target's: token for token with greedy decoding, and in
distribution when sampling (`accept_drafts`). The drafters are in genfast/llm/decoding/drafters.py.

KV caches: slots past the accepted prefix hold rejected tokens' keys and values; they are never
read (the causal mask stops at each query's position) and the next round overwrites them.
"""

from __future__ import annotations

import time
from collections.abc import Sequence

import torch
from torch import Tensor

from genfast.compilation.inductor import compile_fn
from genfast.errors import UserError
from genfast.llm.checkpoints.tokenizer import Tokenizer
from genfast.llm.decoding.drafters import Drafter
from genfast.llm.decoding.generate import Completions, GenerationResult, Generator, TextCallback, positions
from genfast.llm.decoding.sampling import SamplingParams, draw, probabilities
from genfast.llm.model.transformer import Transformer
from genfast.platform.hardware import synchronize

DEFAULT_K = 4
MAX_K = 16


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


class SpeculativeGenerator(Generator):
    """Generator whose decode drafts k tokens and verifies them in one target pass (batch 1).

    Prefill, the plain decode step (used when the drafter has no proposal or fewer than k+1
    cache slots remain) and their compilation are Generator's; the verify step is compiled
    alongside (k+1 tokens: a static shape; the valid cache length is dynamic, as in decode).
    """

    def __init__(
        self,
        model: Transformer,
        tokenizer: Tokenizer,
        drafter: Drafter,
        k: int = DEFAULT_K,
        max_seq_len: int | None = None,
        compile: bool = True,
    ) -> None:
        if not 1 <= k <= MAX_K:
            raise UserError(f"--speculate-k must be between 1 and {MAX_K}, got {k}")
        super().__init__(model, tokenizer, max_seq_len=max_seq_len, max_batch_size=1, compile=compile)
        self.k, self.drafter = k, drafter
        if compile:
            self._verify = compile_fn(self._verify_step, self.device, decode=True, model=model)
        drafter.attach(self)

    def _verify_step(
        self, tokens: Tensor, input_pos: Tensor, mask: Tensor, q: Tensor, params: SamplingParams
    ) -> Tensor:
        """The target over [pending, drafts] and the acceptance rule, in one graph; returns
        [k+2]: the drafts, the next token, the number of drafts accepted (one host sync)."""
        p = probabilities(self.model(tokens, input_pos, mask, all_logits=True)[0], params)
        drafts = tokens[0, 1:]
        n, next_token = accept_drafts(p, q, drafts)
        return torch.cat([drafts, next_token.view(1), n.view(1)])

    def _run_verify(
        self, tokens: Tensor, input_pos: Tensor, mask: Tensor, q: Tensor, params: SamplingParams, steady: bool
    ) -> Tensor:
        if not self.compiled:
            return self._verify_step(tokens, input_pos, mask, q, params)
        if not self.static_kv:
            torch._dynamo.mark_dynamic(mask, 3)  # the valid cache length
        return self._run_compiled(self._verify, steady, tokens, input_pos, mask, q, params)

    @torch.inference_mode()
    def generate(
        self,
        prompts: Sequence[Sequence[int]],
        max_new_tokens: int,
        params: SamplingParams = SamplingParams(),
        stop_strings: Sequence[str] = (),
        seed: int | None = None,
        on_text: TextCallback | None = None,
        stop_at_eos: bool = True,
    ) -> GenerationResult:
        """As Generator.generate, for one prompt; the result also carries acceptance stats."""
        if len(prompts) != 1:
            raise UserError(f"speculative decoding runs one prompt at a time; got {len(prompts)}")
        lengths = self.check_request(prompts, max_new_tokens)
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
            new = new[: end - len(history)]
            history += new
            decode_s += time.perf_counter() - t0
            for tok in new:
                if out.done[0]:
                    break
                out.push(0, tok)
                produced += 1

        passes = verifies + plain
        return out.finish(
            prompt_tokens=lengths[0],
            prefill_s=prefill_s,
            decode_s=decode_s,
            decode_steps=produced,
            mean_kv_len=kv_total / passes if passes else 0.0,
            speculate_k=self.k,
            drafted_tokens=verifies * self.k,
            accepted_tokens=accepted,
            target_passes=passes,
            draft_s=draft_s,
        )

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
        self._run_verify(
            torch.zeros(1, self.k + 1, dtype=torch.long, device=self.device), input_pos, mask, q, params, steady=False
        )
        return time.perf_counter() - t0
