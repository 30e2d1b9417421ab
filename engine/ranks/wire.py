"""The step plan and the ranks' results on the wire (`plan_to_wire` / `plan_from_wire`, `result_to_wire` /
`result_from_wire`): a plan (`pdserve.engine.step`) is a few plain values a plan channel carries as msgpack, its
bulk raw little-endian buffers (msgpack `bin`): per rank and pass, int32 arrays of token ids, positions or chunk
starts and page counts, the page ids flattened, and the sampling fields as float64 and int64 arrays (penalties,
banned tokens and log-probability requests only in a pass that has some); the request ids go as a list of
strings. A result's log-probabilities likewise go only for a pass whose rows asked for them. Neither side makes a
Python object per token or page: a rank reads its rows as `WireRows`, sequences that hold the arrays and make the
row objects only when first read. A rank whose `RankStep` is the same object as an earlier rank's (the same rows
on every rank) is sent as that rank's index. A driver that encodes a plan every step passes a `PageTableCache`,
so a request's page ids, which change once every page_size decode steps, are converted once, and go as uint16
where its cache has at most 65536 pages (else, and without a cache, int32). Pure Python and numpy (no torch).

Past 500 lines on purpose: the encoder and the decoder of each field sit side by side, so that a field added to
the plan (speculation's, structured outputs') is added to both ends of the format in one place."""

from __future__ import annotations

import dataclasses
import struct
from collections.abc import Iterable, Sequence
from itertools import chain
from operator import attrgetter
from typing import Any

import numpy as np

from pdserve.engine.sampling_params import StructuredOutput, TokenLogprobs
from pdserve.engine.step import (
    DecodeRow,
    PrefillRow,
    RankResult,
    RankStep,
    SampleSpec,
    StepPlan,
)

__all__ = [
    "PageTableCache",
    "WireRows",
    "max_pages",
    "plan_from_wire",
    "plan_to_wire",
    "prefill_tokens",
    "result_from_wire",
    "result_to_wire",
]


_I32, _I64, _F64 = np.dtype("<i4"), np.dtype("<i8"), np.dtype("<f8")
_F32 = np.dtype("<f4")
_U16 = np.dtype("<u2")
_PAGE_ID_TYPES = {dtype.itemsize: dtype for dtype in (_U16, _I32)}
"""Page ids go as uint16 where the driver's cache has at most 65536 pages, else int32; the wire names which by
its item size."""
_NO_TOKEN = -1
"""A prefill row's token in a result's int32 array where the row sampled none (token ids are >= 0)."""
_NO_IDS = -1
"""A sample's penalty id count on the wire where its `penalty_ids` is None."""
_PREFILL_FIELDS = attrgetter("request_id", "token_ids", "start", "page_ids", "sample", "next_token")
_DECODE_FIELDS = attrgetter("request_id", "token_id", "position", "page_ids", "sample", "drafts")
_SAMPLE_FIELDS = attrgetter("temperature", "top_p", "min_p", "top_k", "seed", "step", "relaxed")


def _pack(values: Iterable[Any], dtype: np.dtype) -> bytes:
    """Python numbers as the raw bytes of `dtype`; a value out of its range raises OverflowError."""
    return np.fromiter(values, dtype).tobytes()


def _pack_known(code: str, count: int, values: Iterable[Any]) -> bytes:
    """`count` Python numbers as little-endian `struct` `code` values (faster than `_pack` where the count is
    known); a value out of range raises struct.error."""
    return struct.pack(f"<{count}{code}", *values)


def _array(data: bytes, dtype: np.dtype, count: int, what: str) -> np.ndarray:
    """`count` values of `dtype` from the wire (a read-only view of `data`)."""
    if len(data) != count * dtype.itemsize:
        raise ValueError(
            f"plan wire: {what}: {len(data)} bytes, expected {count} x {dtype.itemsize}"
        )
    return np.frombuffer(data, dtype)


def _split(flat: np.ndarray, counts: np.ndarray) -> list[list[int]]:
    """`flat` cut into consecutive lists of `counts` values."""
    values, ends = flat.tolist(), np.cumsum(counts).tolist()
    return [values[a:b] for a, b in zip([0, *ends], ends, strict=False)]  # the starts run one over


def _samples_to_wire(samples: Sequence[SampleSpec]) -> list:
    """float64 [3, samples] (temperature, top_p, min_p), int64 [4, samples] (top_k, seed, step, relaxed), and None
    unless some sample has a penalty, a ban or asks for log-probabilities: then [float64 [3, samples]
    (presence, frequency and repetition penalties), int64 [samples] (logprobs), int32 [2, samples] (penalty id
    counts, -1 for None, and banned id counts), int32 ids (each sample's penalty ids then its banned ids),
    and None unless some sample is constrained: then [its constrained flags (bytes), per sample None or its
    grammar as [kind, text, grammar ids (int32), start_after]]]. Plain samples (most) pay nothing for the rest."""
    if not samples:
        return [b"", b"", None]
    n = len(samples)
    temperature, top_p, min_p, top_k, seed, step, relaxed = zip(
        *map(_SAMPLE_FIELDS, samples), strict=True
    )
    extras = None
    if not all(s.plain for s in samples):
        ids = [chain(s.penalty_ids or (), s.banned_ids) for s in samples]
        extras = [
            _pack_known("d", 3 * n, chain(
                (s.presence_penalty for s in samples), (s.frequency_penalty for s in samples),
                (s.repetition_penalty for s in samples),
            )),
            _pack_known("q", n, (s.logprobs for s in samples)),
            _pack_known("i", 2 * n, chain(
                (_NO_IDS if s.penalty_ids is None else len(s.penalty_ids) for s in samples),
                (len(s.banned_ids) for s in samples),
            )),
            _pack(chain.from_iterable(ids), _I32),
            _grammars_to_wire(samples),
        ]  # fmt: skip
    return [
        _pack_known("d", 3 * n, chain(temperature, top_p, min_p)),
        _pack_known("q", 4 * n, chain(top_k, seed, step, relaxed)),
        extras,
    ]


def _grammars_to_wire(samples: Sequence[SampleSpec]) -> list | None:
    if not any(s.constrained for s in samples):
        return None
    grammars = [
        None
        if s.grammar is None
        else [s.grammar.kind, s.grammar.text, _pack(s.grammar_ids, _I32), s.grammar.start_after]
        for s in samples
    ]
    return [bytes(s.constrained for s in samples), grammars]


def _grammars_from_wire(wire: list | None, n: int, what: str) -> list[tuple]:
    """Per sample (constrained, grammar, grammar ids), as `_grammars_to_wire` packed them."""
    if wire is None:
        return [(False, None, ())] * n
    flags, grammars = wire
    if len(flags) != n or len(grammars) != n:
        raise ValueError(
            f"plan wire: {what} grammars: {len(flags)}, {len(grammars)} for {n} samples"
        )
    out = []
    for flag, grammar in zip(flags, grammars, strict=True):
        if grammar is None:
            out.append((bool(flag), None, ()))
        else:
            kind, text, ids, start_after = grammar
            structured = StructuredOutput(kind, text, start_after)
            out.append((bool(flag), structured, tuple(np.frombuffer(ids, _I32).tolist())))
    return out


def _samples_from_wire(
    floats: bytes, ints: bytes, extras: list | None, n: int, what: str
) -> tuple[np.ndarray, np.ndarray, list[tuple] | None]:
    """The arrays `_samples_to_wire` packed, the extras as one tuple per sample (penalties, logprobs, penalty
    ids, banned ids, constrained, grammar, grammar ids) or None."""
    rows = None
    if extras is not None:
        penalties, logprobs, counts, ids, grammars = extras
        penalties = _array(penalties, _F64, 3 * n, f"{what} penalties").reshape(3, n)
        logprobs = _array(logprobs, _I64, n, f"{what} logprobs")
        counts = _array(counts, _I32, 2 * n, f"{what} penalty counts").reshape(2, n)
        ids = _array(ids, _I32, int(counts.clip(min=0).sum()), f"{what} penalty ids").tolist()
        rows, at = [], 0
        for p, f, r, k, num_penalty, num_banned, grammar in zip(
            *penalties.tolist(), logprobs.tolist(), *counts.tolist(),
            _grammars_from_wire(grammars, n, what), strict=True,
        ):  # fmt: skip
            mid = at + max(num_penalty, 0)
            end = mid + num_banned
            penalty_ids = None if num_penalty == _NO_IDS else tuple(ids[at:mid])
            rows.append((p, f, r, k, penalty_ids, tuple(ids[mid:end]), *grammar))
            at = end
    return (
        _array(floats, _F64, 3 * n, f"{what} sampling floats").reshape(3, n),
        _array(ints, _I64, 4 * n, f"{what} sampling ints").reshape(4, n),
        rows,
    )


def _sample_specs(
    floats: np.ndarray, ints: np.ndarray, extras: list[tuple] | None
) -> list[SampleSpec]:
    """The specs `_samples_to_wire` packed, as `_samples_from_wire` reads them."""
    specs = [
        SampleSpec(temperature, top_p, top_k, min_p, seed, step, relaxed=bool(relaxed))
        for temperature, top_p, min_p, top_k, seed, step, relaxed in zip(
            *floats.tolist(), *ints.tolist(), strict=True
        )
    ]
    if extras is None:
        return specs
    return [
        dataclasses.replace(spec, presence_penalty=p, frequency_penalty=f, repetition_penalty=r,
                            logprobs=k, penalty_ids=penalty_ids, banned_ids=banned_ids,
                            constrained=constrained, grammar=grammar, grammar_ids=grammar_ids)
        for spec, (p, f, r, k, penalty_ids, banned_ids, constrained, grammar, grammar_ids) in zip(
            specs, extras, strict=True
        )
    ]  # fmt: skip


class PageTableCache:
    """A driver's memory of the page ids it last put on the wire, per request, as wire bytes. A request's page
    ids change once every page_size decode steps (or when it is preempted and prefilled again), so most steps
    reuse them; a row's page ids are compared with the remembered ones every step, never assumed unchanged.
    Remembers the requests of the last plan encoded only. One per driver, used from one thread.

    num_pages: the driver's page ids are below it (a rank's KV pages); up to 65536 they go as uint16, half the
    bytes of int32."""

    def __init__(self, num_pages: int) -> None:
        if num_pages <= 0:
            raise ValueError(f"num_pages={num_pages}: must be positive")
        self._dtype = _U16 if num_pages <= 1 << 16 else _I32
        self._last: dict[str, tuple[list[int], bytes]] = {}
        self._next: dict[str, tuple[list[int], bytes]] = {}

    def _page_ids(self, request_ids: Sequence[str], page_ids: Sequence[list[int]]) -> list:
        last, next_, blobs = self._last, self._next, []
        for request_id, pages in zip(request_ids, page_ids, strict=True):
            known = last.get(request_id)
            if known is None or known[0] != pages:
                # a copy of the pages: the plan's list is not ours to keep
                known = (list(pages), _pack(pages, self._dtype))
            next_[request_id] = known
            blobs.append(known[1])
        return [self._dtype.itemsize, b"".join(blobs)]

    def _plan_done(self) -> None:
        self._last, self._next = self._next, {}


def _page_ids_to_wire(
    request_ids: Sequence[str], page_ids: Sequence[list[int]], cache: PageTableCache | None
) -> list:
    """[bytes per page id, the page ids, row after row]."""
    if cache is not None:
        return cache._page_ids(request_ids, page_ids)
    return [_I32.itemsize, _pack(chain.from_iterable(page_ids), _I32)]


class WireRows(Sequence):
    """One pass's rows as a rank reads them off the wire: their fields as read-only numpy arrays (for a reader
    that needs no row objects) and, as a sequence, the row objects, made on first access and kept. Equal to any
    list or tuple of the same rows. Every kind has `request_ids` (a list), `page_counts` int32 [rows],
    `page_ids` uint16 or int32 [sum of page_counts] (row after row), and for its sampled rows
    `sample_floats` float64 [3, sampled] (temperature, top_p, min_p) and `sample_ints` int64 [4, sampled]
    (top_k, seed, step, relaxed), and `sample_extras`: None, or per sampled row its penalties, logprobs and ids
    (`_samples_from_wire`)."""

    __slots__ = (
        "request_ids", "page_counts", "page_ids", "sample_floats", "sample_ints", "sample_extras",
        "_rows",
    )  # fmt: skip

    def __init__(self, what: str, request_ids: list[str], page_counts: np.ndarray, page_ids: list):
        self.request_ids, self.page_counts = request_ids, page_counts
        itemsize, data = page_ids
        dtype = _PAGE_ID_TYPES.get(itemsize)
        if dtype is None:
            raise ValueError(f"plan wire: {what} page ids of {itemsize} bytes")
        self.page_ids = _array(data, dtype, int(page_counts.sum()), f"{what} page ids")
        self._rows: list | None = None

    def _make(self) -> list:
        raise NotImplementedError

    def _made(self) -> list:
        if self._rows is None:
            self._rows = self._make()
        return self._rows

    def __len__(self) -> int:
        return len(self.request_ids)

    def __getitem__(self, index):
        return self._made()[index]

    def __iter__(self):
        return iter(self._made())

    def __eq__(self, other: object) -> bool:
        if isinstance(other, WireRows | list | tuple):
            return self._made() == list(other)
        return NotImplemented

    __hash__ = None  # type: ignore[assignment]  # equal to lists, so unhashable as they are

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self._made()!r})"


def prefill_tokens(rows: Sequence[PrefillRow]) -> int:
    """Prompt tokens of a pass's prefill rows, from the wire's counts where the rows came off it (no row
    objects made)."""
    if isinstance(rows, _PrefillWireRows):
        return int(rows.token_counts.sum())
    return sum(len(r.token_ids) for r in rows)


def max_pages(rows: Sequence[PrefillRow | DecodeRow]) -> int:
    """The widest page table of a pass's rows (0 for none), from the wire's counts where it can."""
    if isinstance(rows, WireRows):
        return int(rows.page_counts.max(initial=0))
    return max((len(r.page_ids) for r in rows), default=0)


def _heads(data: bytes, rows: int, what: str) -> np.ndarray:
    """A pass's int32 [4, rows] per-row fields, the page counts third."""
    return _array(data, _I32, 4 * rows, f"{what} rows").reshape(4, rows)


class _PrefillWireRows(WireRows):
    """Also `starts`, `token_counts` int32 [rows], `token_ids` int32 [sum of token_counts], `sampled` bool
    [rows] and `next_tokens` int32 [rows] (-1: None)."""

    __slots__ = ("starts", "token_counts", "token_ids", "sampled", "next_tokens")

    def __init__(self, wire: list):
        request_ids, heads, token_ids, page_ids, sampled, floats, ints, extras = wire
        n = len(request_ids)
        self.starts, self.token_counts, page_counts, self.next_tokens = _heads(heads, n, "prefill")
        super().__init__("prefill", request_ids, page_counts, page_ids)
        self.token_ids = _array(token_ids, _I32, int(self.token_counts.sum()), "prefill token ids")
        self.sampled = _array(sampled, np.dtype(np.bool_), n, "prefill sample flags")
        self.sample_floats, self.sample_ints, self.sample_extras = _samples_from_wire(
            floats, ints, extras, int(self.sampled.sum()), "prefill"
        )

    def _make(self) -> list[PrefillRow]:
        specs = iter(_sample_specs(self.sample_floats, self.sample_ints, self.sample_extras))
        samples = [next(specs) if s else None for s in self.sampled.tolist()]
        next_tokens = [None if t == _NO_TOKEN else t for t in self.next_tokens.tolist()]
        return list(
            map(
                PrefillRow, self.request_ids, _split(self.token_ids, self.token_counts),
                self.starts.tolist(), _split(self.page_ids, self.page_counts), samples, next_tokens,
            )
        )  # fmt: skip


class _DecodeWireRows(WireRows):
    """Also `token_ids`, `positions` and `drafts` int32 [rows]."""

    __slots__ = ("token_ids", "positions", "drafts")

    def __init__(self, wire: list):
        request_ids, heads, page_ids, floats, ints, extras = wire
        n = len(request_ids)
        self.token_ids, self.positions, page_counts, self.drafts = _heads(heads, n, "decode")
        super().__init__("decode", request_ids, page_counts, page_ids)
        self.sample_floats, self.sample_ints, self.sample_extras = _samples_from_wire(
            floats, ints, extras, n, "decode"
        )

    def _make(self) -> list[DecodeRow]:
        return list(
            map(
                DecodeRow, self.request_ids, self.token_ids.tolist(), self.positions.tolist(),
                _split(self.page_ids, self.page_counts),
                _sample_specs(self.sample_floats, self.sample_ints, self.sample_extras),
                self.drafts.tolist(),
            )
        )  # fmt: skip


def _prefill_to_wire(rows: Sequence[PrefillRow], cache: PageTableCache | None) -> list | None:
    """[request ids, int32 [4, rows] (start, token count, page count, next token or -1), token ids, page
    ids, one byte per row (1: sampled), the sampled rows' `_samples_to_wire`], None for no rows."""
    if not rows:
        return None
    n = len(rows)
    request_ids, tokens, starts, pages, samples, nexts = zip(
        *map(_PREFILL_FIELDS, rows), strict=True
    )
    nexts = (_NO_TOKEN if t is None else t for t in nexts)
    return [
        list(request_ids),
        _pack_known("i", 4 * n, chain(starts, map(len, tokens), map(len, pages), nexts)),
        _pack(chain.from_iterable(tokens), _I32),
        _page_ids_to_wire(request_ids, pages, cache),
        bytes(s is not None for s in samples),
        *_samples_to_wire([s for s in samples if s is not None]),
    ]


def _decode_to_wire(rows: Sequence[DecodeRow], cache: PageTableCache | None) -> list | None:
    """[request ids, int32 [4, rows] (token id, position, page count, drafts), page ids,
    `_samples_to_wire`], None for no rows."""
    if not rows:
        return None
    n = len(rows)
    request_ids, tokens, positions, pages, samples, drafts = zip(
        *map(_DECODE_FIELDS, rows), strict=True
    )
    return [
        list(request_ids),
        _pack_known("i", 4 * n, chain(tokens, positions, map(len, pages), drafts)),
        _page_ids_to_wire(request_ids, pages, cache),
        *_samples_to_wire(samples),
    ]


def plan_to_wire(plan: StepPlan, cache: PageTableCache | None = None) -> list:
    """The plan as msgpack-ready values: [step_id, per rank: [prefill pass, decode pass] (each None when it
    has no rows), or the index of an earlier rank whose `RankStep` is the same object, mtp, num_drafts].
    cache: the driver's `PageTableCache` when it encodes a plan every step."""
    first_rank: dict[int, int] = {}
    ranks: list = []
    for rank, step in enumerate(plan.ranks):
        same = first_rank.setdefault(id(step), rank)
        if same != rank:
            ranks.append(same)
        else:
            prefill = _prefill_to_wire(step.prefill, cache)
            ranks.append([prefill, _decode_to_wire(step.decode, cache)])
    if cache is not None:
        cache._plan_done()
    return [plan.step_id, ranks, plan.mtp, plan.num_drafts, plan.relaxed_topk, plan.relaxed_delta]


def plan_from_wire(wire: list) -> StepPlan:
    """The plan `plan_to_wire` encoded, its rows as `WireRows` (ranks sent as an index share one `RankStep`).
    Raises ValueError where the wire's arrays disagree with their counts."""
    step_id, ranks_wire, mtp, num_drafts, relaxed_topk, relaxed_delta = wire
    ranks: list[RankStep] = []
    for rank, entry in enumerate(ranks_wire):
        if isinstance(entry, int):
            if not 0 <= entry < rank:
                raise ValueError(f"plan wire: rank {rank} refers to rank {entry}")
            ranks.append(ranks[entry])
            continue
        prefill, decode = entry
        ranks.append(
            RankStep(
                [] if prefill is None else _PrefillWireRows(prefill),
                [] if decode is None else _DecodeWireRows(decode),
            )
        )
    return StepPlan(
        step_id, ranks, bool(mtp), int(num_drafts), int(relaxed_topk), float(relaxed_delta)
    )


def _logprobs_to_wire(logprobs: Sequence[TokenLogprobs | None]) -> list | None:
    """None when no row has log-probabilities (a pass of requests that asked for none pays nothing); else
    [int32 [rows] alternatives per row (-1: none for the row), float32 [rows with some] sampled logprob, int32
    top ids, float32 top logprobs (rows with some, one after another)]."""
    if not any(lp is not None for lp in logprobs):
        return None
    given = [lp for lp in logprobs if lp is not None]
    return [
        _pack((-1 if lp is None else len(lp.top_ids) for lp in logprobs), _I32),
        _pack((lp.logprob for lp in given), _F32),
        _pack(chain.from_iterable(lp.top_ids for lp in given), _I32),
        _pack(chain.from_iterable(lp.top_logprobs for lp in given), _F32),
    ]


def _logprobs_from_wire(wire: list | None, rows: int, what: str) -> list[TokenLogprobs | None]:
    if wire is None:
        return []
    counts, sampled, top_ids, top_logprobs = wire
    counts = _array(counts, _I32, rows, f"{what} logprob counts").tolist()
    given = sum(c >= 0 for c in counts)
    sampled = _array(sampled, _F32, given, f"{what} logprobs").tolist()
    total = sum(c for c in counts if c > 0)
    top_ids = _array(top_ids, _I32, total, f"{what} top ids").tolist()
    top_logprobs = _array(top_logprobs, _F32, total, f"{what} top logprobs").tolist()
    out: list[TokenLogprobs | None] = []
    i = at = 0
    for count in counts:
        if count < 0:
            out.append(None)
            continue
        end = at + count
        out.append(TokenLogprobs(sampled[i], tuple(top_ids[at:end]), tuple(top_logprobs[at:end])))
        i, at = i + 1, end
    return out


def _drafts_to_wire(drafts: Sequence[Sequence[int]]) -> list | None:
    """None for no drafts; else [int32 [rows] draft counts, int32 drafts (row after row)]."""
    if not drafts:
        return None
    return [_pack(map(len, drafts), _I32), _pack(chain.from_iterable(drafts), _I32)]


def _drafts_from_wire(wire: list | None, what: str) -> list[list[int]]:
    if wire is None:
        return []
    counts, flat = wire
    counts = np.frombuffer(counts, _I32)
    return _split(_array(flat, _I32, int(counts.sum()), f"{what} drafts"), counts)


def result_to_wire(result: RankResult) -> list:
    """[step_id, prefill tokens (int32, -1 for a row that sampled none), decode tokens (int32), prefill
    error, decode error, row errors ([[request id, why], ...], None for none), prefill and decode
    log-probabilities (`_logprobs_to_wire`: None when no row of the pass asked for them), decode accepted
    counts (int32, empty when none verified), prefill and decode drafts (`_drafts_to_wire`)].
    Log-probabilities go as float32, what the model's log-softmax gives."""
    prefill = (_NO_TOKEN if t is None else t for t in result.prefill_tokens)
    return [
        result.step_id, _pack(prefill, _I32), _pack(result.decode_tokens, _I32),
        result.prefill_error, result.decode_error,
        [list(e) for e in result.row_errors.items()] if result.row_errors else None,
        _logprobs_to_wire(result.prefill_logprobs), _logprobs_to_wire(result.decode_logprobs),
        _pack(result.decode_accepted, _I32), _drafts_to_wire(result.prefill_drafts),
        _drafts_to_wire(result.decode_drafts),
    ]  # fmt: skip


def result_from_wire(wire: list) -> RankResult:
    (
        step_id, prefill, decode, prefill_error, decode_error, row_errors, prefill_lp, decode_lp,
        accepted, prefill_drafts, decode_drafts,
    ) = wire  # fmt: skip
    prefill_tokens = np.frombuffer(prefill, _I32).tolist()
    decode_tokens = np.frombuffer(decode, _I32).tolist()
    return RankResult(
        step_id,
        [None if t == _NO_TOKEN else t for t in prefill_tokens],
        decode_tokens,
        prefill_error,
        decode_error,
        _logprobs_from_wire(prefill_lp, len(prefill_tokens), "prefill"),
        _logprobs_from_wire(decode_lp, len(decode_tokens), "decode"),
        np.frombuffer(accepted, _I32).tolist(),
        _drafts_from_wire(prefill_drafts, "prefill"),
        _drafts_from_wire(decode_drafts, "decode"),
        row_errors=dict(row_errors or ()),
    )
