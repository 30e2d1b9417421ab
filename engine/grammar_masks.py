"""The runner's side of structured outputs: one llguidance matcher per constrained request it samples, kept
between steps as its penalty counts are (`GrammarMatchers`), and each pass's token bitmask over the
constrained rows (`RowMasks`), applied to their logits in one batched op before sampling.

The bitmask is filled on the host, by llguidance's thread pool, after the pass's forward has been launched and
before anything reads its logits back: on a GPU the fill runs while the forward (a CUDA-graph replay) does,
and the graph itself is untouched. Only the constrained rows' logits change; the other rows are copied as
they are, so a constrained neighbour changes no other request's token."""

from __future__ import annotations

import collections
import dataclasses
import json
import os
from collections.abc import Sequence
from pathlib import Path

import llguidance
import torch

from pdserve.engine.grammar import to_grammar
from pdserve.engine.sampling_params import StructuredOutput
from pdserve.engine.step import SampleSpec

__all__ = ["GrammarMatchers", "RowMasks"]

COMPILED_CACHE_SIZE = 256
"""Distinct constraints whose fresh matcher a runner keeps to copy for the next request with the same one
(llguidance builds a grammar's lexer states lazily, as tokens reach them: a copy keeps those built)."""
_BITS = torch.arange(32, dtype=torch.int32)
_ALL_ALLOWED = -1
"""A bitmask word with every bit set (int32)."""


@dataclasses.dataclass(frozen=True, slots=True)
class RowMasks:
    """A pass's constrained rows (`rows`, [C] int64) and their allowed tokens (`bitmask`, [C, ceil(V / 32)]
    int32, bit t % 32 of word t // 32 set where token t is allowed), both on the logits' device; `row_ids`:
    the rows on the host."""

    rows: torch.Tensor
    bitmask: torch.Tensor
    row_ids: tuple[int, ...]

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        """logits [B, V] with the disallowed tokens of the constrained rows at -inf (a new tensor; the rows
        not constrained are copied unchanged)."""
        out = logits.clone()
        allowed = (self.bitmask[:, :, None] >> _BITS.to(logits.device)) & 1  # [C, W, 32]
        allowed = allowed.view(allowed.shape[0], -1)[:, : logits.shape[1]].bool()  # [C, V]
        out[self.rows] = out[self.rows].masked_fill(~allowed, float("-inf"))
        return out


class GrammarMatchers:
    """The grammar matchers of the constrained requests this runner samples. A request's matcher starts on the
    row that carries its constraint (`SampleSpec.grammar`, with the tokens it generated before:
    `SampleSpec.grammar_ids`) and advances by each token sampled for it here; a request missing from a step's
    rows is gone from this runner, and `keep` drops its matcher (as `PenaltyCounts.keep`).

    tokenizer_file: the checkpoint's tokenizer.json (None, or missing: a constrained row fails with a reason);
    vocab_size: the model's logits width (ids past the tokenizer's are never allowed); eos_token_ids: what the
    grammar allows once it accepts."""

    def __init__(
        self, tokenizer_file: Path | None, vocab_size: int, eos_token_ids: Sequence[int]
    ) -> None:
        self._tokenizer_file = tokenizer_file
        self._vocab_size = vocab_size
        self._eos = list(eos_token_ids)
        self._tokenizer: llguidance.LLTokenizer | None = None
        self._added: dict[str, int] = {}
        """The vocabulary's added tokens that are not special (text to id: `</think>`, tool-call markers),
        read with the tokenizer: a choice of their text takes them (`grammar.to_grammar`)."""
        self._executor: llguidance.LLExecutor | None = None
        self._matchers: dict[str, llguidance.LLMatcher] = {}
        self._waiting: dict[str, int] = {}
        """The requests whose constraint has not started (`StructuredOutput.start_after`), to the token that
        starts it: their rows are free until it is sampled, their matchers fresh."""
        self._compiled: collections.OrderedDict[tuple[str, str], llguidance.LLMatcher] = (
            collections.OrderedDict()
        )
        """Fresh matchers by constraint (kind, text)."""
        self._host: torch.Tensor | None = None
        """The host bitmask, grown to the largest pass (pinned where a GPU is, for an asynchronous copy)."""
        self.words = (vocab_size + 31) // 32

    def __len__(self) -> int:
        return len(self._matchers)

    def masks(
        self, request_ids: Sequence[str], specs: Sequence[SampleSpec], device: torch.device,
        drafts: Sequence[Sequence[int]] = (),
    ) -> tuple[RowMasks | None, dict[str, str]]:  # fmt: skip
        """The constrained rows' masks (None where no row is constrained) on `device`, and the requests whose
        grammar failed (no matcher, an error, or no token allowed), with why; their rows' masks allow every
        token, and their tokens are to be dropped. drafts: per row, where the pass verifies drafts, the
        tokens of the drafts after it on a verify group's first row (the group's other rows: masked as if
        those drafts were taken, as far as the grammar takes them; the rows past a draft it refuses allow
        every token, that draft being rejected by the mask before them), else empty. A request whose
        constraint has not started (`StructuredOutput.start_after`) has its rows free up to the one after
        its start token, where a draft is that token, and masked from there."""
        rows = [i for i, s in enumerate(specs) if s.constrained]
        if not rows:
            return None, {}
        errors: dict[str, str] = {}
        targets: list[tuple[llguidance.LLMatcher, int, list[int]]] = []
        in_group: set[int] = set()  # a verify group's draft rows: masked with its first row
        for j, i in enumerate(rows):
            if i in in_group:
                continue
            ahead = list(drafts[i]) if drafts else []
            in_group.update(range(i + 1, i + 1 + len(ahead)))
            request_id, error = request_ids[i], None
            try:
                matcher = self._matcher(request_id, specs[i])
                if matcher.is_error():
                    error = matcher.get_error()
            except (
                Exception
            ) as e:  # a tokenizer or grammar that cannot load fails its request alone
                matcher, error = None, f"{type(e).__name__}: {e}"
            if error is None and request_id in self._waiting:
                start = self._waiting[request_id]
                if start not in ahead:
                    continue  # free: every row of the group allows every token
                k = ahead.index(start)  # the rows after the draft that starts it are masked
                targets.append((matcher, j + k + 1, ahead[k + 1 :]))
            elif error is None:
                targets.append((matcher, j, ahead))
            else:
                errors[request_id] = f"structured output failed: {error}"
        host = self._buffer(len(rows))
        host.fill_(_ALL_ALLOWED)
        if targets:
            executor = self._executor_()
            if any(ahead for _, _, ahead in targets):
                executor.unsafe_compute_mask_ptr_with_draft_token(
                    targets, host.data_ptr(), self.words * 4, len(rows)
                )
            else:
                executor.unsafe_compute_mask_ptr(
                    [(m, j) for m, j, _ in targets], host.data_ptr(), self.words * 4, len(rows)
                )
            empty = (host == 0).all(dim=1).tolist()
            for j in [j for j, none_allowed in enumerate(empty) if none_allowed]:
                host[j] = _ALL_ALLOWED  # a draft row past a refused draft, or a failed grammar
            for _, j, _ in targets:
                if empty[j]:
                    errors[request_ids[rows[j]]] = (
                        "structured output failed: the grammar allows no token here (min_tokens "
                        "or a stop token may hold back the end it needs)"
                    )
        index = torch.tensor(rows, dtype=torch.int64).to(device, non_blocking=True)
        return RowMasks(index, host.to(device, non_blocking=True), tuple(rows)), errors

    def accept(
        self, request_ids: Sequence[str], specs: Sequence[SampleSpec], tokens: Sequence[int],
        errors: dict[str, str], accepted: Sequence[int] = (),
    ) -> None:  # fmt: skip
        """Advances the constrained rows' matchers by their sampled tokens, adding to `errors` a request whose
        grammar refuses one (requests in `errors` already are skipped). accepted: where the pass verified
        drafts, per row the tokens it keeps from there (`Verified.accepted`: a verify group's kept tokens
        on its first row, 0 on its other rows); else one each."""
        for r, (request_id, spec) in enumerate(zip(request_ids, specs, strict=True)):
            if not spec.constrained or request_id in errors:
                continue
            kept = tokens[r : r + (accepted[r] if accepted else 1)]
            if not kept:
                continue  # a draft's row: its group's first row took its token
            matcher = self._matchers.get(request_id)
            if matcher is not None and request_id in self._waiting:
                kept = self._started(request_id, kept)
            if matcher is None or not self._consume(matcher, kept):
                why = "no matcher" if matcher is None else matcher.get_error()
                errors[request_id] = f"structured output failed: tokens {kept} refused ({why})"

    def _started(self, request_id: str, tokens: Sequence[int]) -> Sequence[int]:
        """The tokens after a waiting request's start token, where they hold it (it is no longer waiting
        then); else none."""
        start = self._waiting[request_id]
        if start not in tokens:
            return ()
        del self._waiting[request_id]
        return tokens[list(tokens).index(start) + 1 :]

    def _consume(self, matcher: llguidance.LLMatcher, tokens: Sequence[int]) -> bool:
        """Whether the matcher takes `tokens`; an end-of-sequence token where the grammar has accepted ends
        them (the request finishes there; a matcher that a draft's mask stopped and rolled back may not take
        it again)."""
        for token in tokens:
            if token in self._eos and (matcher.is_stopped() or matcher.is_accepting()):
                return True
            if not matcher.consume_token(token):
                return False
        return True

    def keep(self, request_ids: set[str]) -> None:
        """Drops the matchers of every request not in `request_ids` (a step's rows)."""
        for request_id in [r for r in self._matchers if r not in request_ids]:
            del self._matchers[request_id]
            self._waiting.pop(request_id, None)

    def _matcher(self, request_id: str, spec: SampleSpec) -> llguidance.LLMatcher:
        if (
            spec.grammar is not None
        ):  # (re)started here: a fresh copy, advanced by its tokens so far
            matcher = self._fresh(spec.grammar)
            ids = spec.grammar_ids
            self._waiting.pop(request_id, None)
            if spec.grammar.start_after is not None:
                self._waiting[request_id] = spec.grammar.start_after
                ids = self._started(request_id, ids)
            if ids and not matcher.consume_tokens(list(ids)):
                raise ValueError(f"its generated tokens do not match it ({matcher.get_error()})")
            self._matchers[request_id] = matcher
            return matcher
        matcher = self._matchers.get(request_id)
        if matcher is None:
            raise RuntimeError(f"request {request_id}: no grammar matcher on this runner")
        return matcher

    def _fresh(self, structured: StructuredOutput) -> llguidance.LLMatcher:
        key = (structured.kind, structured.text)
        base = self._compiled.get(key)
        if base is None:
            tokenizer = self._tokenizer_()
            grammar = to_grammar(structured, self._added)
            base = llguidance.LLMatcher(tokenizer, grammar, log_level=0)
            if base.is_error():
                raise ValueError(base.get_error())
            self._compiled[key] = base
            if len(self._compiled) > COMPILED_CACHE_SIZE:
                self._compiled.popitem(last=False)
        else:
            self._compiled.move_to_end(key)
        return base.deep_copy()

    def _tokenizer_(self) -> llguidance.LLTokenizer:
        if self._tokenizer is None:
            file = self._tokenizer_file
            if file is None or not file.is_file():
                raise FileNotFoundError(
                    f"structured outputs need the checkpoint's tokenizer.json ({file} is missing)"
                )
            text = file.read_text()
            self._added = {
                t["content"]: t["id"]
                for t in json.loads(text).get("added_tokens", ())
                if not t.get("special") and t["id"] < self._vocab_size
            }
            self._tokenizer = _text_tokenizer(text, self._vocab_size, self._eos)
        return self._tokenizer

    def _executor_(self) -> llguidance.LLExecutor:
        if self._executor is None:
            self._executor = llguidance.LLExecutor(num_threads=min(8, os.cpu_count() or 1))
        return self._executor

    def _buffer(self, rows: int) -> torch.Tensor:
        if self._host is None or self._host.shape[0] < rows:
            size = max(rows, 2 * (self._host.shape[0] if self._host is not None else 8))
            self._host = torch.empty(
                size, self.words, dtype=torch.int32, pin_memory=torch.cuda.is_available()
            )
        return self._host[:rows]


class _NoAddedTokens:
    """A tokenizer for llguidance (`llguidance.TokenizerWrapper`'s protocol) with `base`'s vocabulary and
    special tokens, whose text tokenization never yields an added token: where `base` makes one of a piece of
    text (`</think>`, a tool-call marker), the pieces of its text come instead.

    llguidance holds every added token as a special token (its bytes are not its text's), yet tokenizes the
    text a grammar forces (a literal, a JSON `const`) with the checkpoint's tokenizer, which makes an added
    token of its text: the mask would allow that token and the matcher refuse it once sampled. Forced text
    tokenized here is made of tokens whose bytes are its text, so the matcher takes them."""

    def __init__(self, base: llguidance.LLTokenizer, eos_token_ids: Sequence[int]) -> None:
        size = base.vocab_size
        self._base = base
        self.special_token_ids = [t for t in range(size) if base.is_special_token(t)]
        self._special = frozenset(self.special_token_ids)
        self.tokens = [base.decode_bytes([t]) for t in range(size)]
        self.eos_token_id = eos_token_ids[0] if eos_token_ids else None
        self.bos_token_id = None

    def __call__(self, text: bytes) -> list[int]:
        ids = []
        for token in self._base.tokenize_bytes(text):
            if token in self._special:  # its text's bytes, in the vocabulary's pieces
                ids += self._base.greedy_tokenize(self._base.decode_str([token]))
            else:
                ids.append(token)
        return ids


def _text_tokenizer(
    tokenizer_json: str, vocab_size: int, eos_token_ids: Sequence[int]
) -> llguidance.LLTokenizer:
    """llguidance's tokenizer of the checkpoint's tokenizer.json (`_NoAddedTokens`)."""
    base = llguidance.LLTokenizer(tokenizer_json, n_vocab=vocab_size, eos_token=list(eos_token_ids))
    wrapper = llguidance.TokenizerWrapper(_NoAddedTokens(base, eos_token_ids))
    return llguidance.LLTokenizer(wrapper, n_vocab=vocab_size, eos_token=list(eos_token_ids))
