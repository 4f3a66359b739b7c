"""Constrained output on the rank: one llguidance matcher per constrained request, and the
token masks its rows are sampled under (docs/architecture.md §4b).

The batcher ships each constrained request's grammar already compiled and checked; the rank
builds a matcher for it on admission, feeds it every token the request commits (the resumed
ones too, so a request recovered after a crash is constrained exactly as before), and
before each of its rows is sampled computes the mask of the tokens the grammar allows next.
Masks are computed on a helper thread while the launch runs (llguidance releases the GIL),
and applied to their own rows alone.
"""

from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor

import torch
from llguidance import LLMatcher, LLTokenizer

_BITS = torch.arange(32, dtype=torch.int32)


class ConstraintError(ValueError):
    """A constrained request whose grammar or tokens the matcher refused."""


class Constraints:
    """The rank's llguidance tokenizer (built on first use) and its mask computations."""

    def __init__(self, tokenizer_json: str, vocab_size: int, eos_token_ids: tuple[int, ...]):
        self.tokenizer_json = tokenizer_json
        self.vocab_size = vocab_size
        self.eos_token_ids = list(eos_token_ids)
        self._tokenizer: LLTokenizer | None = None
        self._pool: ThreadPoolExecutor | None = None

    @property
    def tokenizer(self) -> LLTokenizer:
        """The vocabulary as llguidance reads it (about a second to build, once)."""
        if self._tokenizer is None:
            self._tokenizer = LLTokenizer(
                self.tokenizer_json, n_vocab=self.vocab_size, eos_token=self.eos_token_ids
            )
        return self._tokenizer

    def matcher(self, grammar: str, committed: list[int]) -> LLMatcher:
        """A matcher for `grammar` that has consumed the tokens `committed` so far."""
        matcher = LLMatcher(self.tokenizer, grammar, log_level=0)
        if committed and not matcher.consume_tokens(committed):
            raise ConstraintError(f"resumed tokens break the constraint: {matcher.get_error()}")
        if matcher.is_error():
            raise ConstraintError(f"the constraint does not compile: {matcher.get_error()}")
        return matcher

    def masks(self, matchers: list[LLMatcher]) -> torch.Tensor:
        """[len(matchers), vocab] bool: the tokens each matcher allows next."""
        words = (self.vocab_size + 31) // 32
        bitmask = torch.empty((len(matchers), words), dtype=torch.int32)
        for row, matcher in enumerate(matchers):
            view = bitmask[row]
            matcher.unsafe_compute_mask_ptr(view.data_ptr(), view.numel() * 4)
        bits = (bitmask[:, :, None] >> _BITS) & 1
        return bits.reshape(len(matchers), words * 32)[:, : self.vocab_size].bool()

    def masks_soon(self, matchers: list[LLMatcher]) -> Future[torch.Tensor]:
        """`masks(matchers)` on the helper thread, to overlap a launch."""
        if self._pool is None:
            self._pool = ThreadPoolExecutor(1, thread_name_prefix="npu-pool-masks")
        return self._pool.submit(self.masks, matchers)

    def draft_masks(self, matchers: list[LLMatcher], drafts: list[int]) -> torch.Tensor:
        """[n, vocab] bool: what each matcher allows after its draft token, where it allows
        the draft (the matcher is left as it was); all allowed where it does not (that
        row's draft is rejected, so its second position is never used)."""
        out = torch.ones((len(matchers), self.vocab_size), dtype=torch.bool)
        taken = [i for i, (m, d) in enumerate(zip(matchers, drafts)) if m.try_consume_tokens([d])]
        if taken:
            out[taken] = self.masks([matchers[i] for i in taken])
            for i in taken:
                matchers[i].rollback(1)
        return out

    def close(self) -> None:
        """Stop the helper thread."""
        if self._pool is not None:
            self._pool.shutdown(wait=False)
