"""Actor-call payloads round-trip through msgpack, typed errors included (no pickle)."""

from __future__ import annotations

import msgpack
import pytest

from pdserve.engine import messages
from pdserve.engine.messages import (
    DecodeRequest,
    DecodeStats,
    PrefillFailure,
    PrefillHandoff,
    PrefillRequest,
    RequestOutput,
    Reservation,
    SpecCounts,
    StageTimes,
)
from pdserve.engine.sampling_params import SamplingParams, TokenLogprobs
from pdserve.model.errors import CapacityError, InvalidRequestError, TransferError

PARAMS = SamplingParams(max_tokens=7, temperature=0.5, top_k=3, seed=11, stop_token_ids=(4, 5))


@pytest.mark.parametrize(
    "value, hint",
    [
        (PrefillRequest("r1", [0, 5, 6], PARAMS, 2, "decode-0", 9), PrefillRequest),
        (PrefillRequest("r1", [0, 5, 6], PARAMS, 2, "decode-0", 9, (4, 40)), PrefillRequest),
        (DecodeRequest("r2", [0, 1], PARAMS, None, [3]), DecodeRequest),
        (DecodeRequest("r3", [0, 1], PARAMS, "prefill-1"), DecodeRequest),
        (Reservation(4, 2), Reservation),
        (Reservation(4, 50, (4, 40)), Reservation),
        (Reservation(4, 50, (4, 40), "decode-0.r1", 12), Reservation),  # 12 pages held there
        (PrefillRequest("r1", [0, 5, 6] * 9, PARAMS, 0, "decode-0", 9, (), 6), PrefillRequest),
        (DecodeStats("decode-0", 1, 2, 3, 4, 5, 16, 0), DecodeStats),
        (DecodeStats("decode-0", 1, 2, 3, 4, 5, 16, 0, SpecCounts(9, 5, 4), (3, 2)), DecodeStats),
        (
            [
                RequestOutput("a", [7], "length", spec=SpecCounts(6, 3, 3)),
                RequestOutput("b", [], preempted=True, spec=SpecCounts(2, 0, 1)),
            ],
            list[RequestOutput],
        ),  # fmt: skip
        (
            [RequestOutput("a", [1, 2]), RequestOutput("b", [], "abort", "lost", False)],
            list[RequestOutput],
        ),
        ([PrefillFailure("c", "prefill worker p: boom")], list[PrefillFailure]),
        (
            PrefillHandoff(TokenLogprobs(-0.25, (3, 9), (-0.25, -2.0)), StageTimes(0.5, 1.0, 0.25)),
            PrefillHandoff,
        ),
        (PrefillHandoff(), PrefillHandoff),
    ],
)
def test_round_trip(value, hint):
    data = messages.encode(value)
    assert isinstance(msgpack.unpackb(data), dict | list)  # plain msgpack, readable anywhere
    assert messages.decode(hint, data) == value


def test_errors_are_raised_again_with_their_type_and_field():
    def invalid():
        raise InvalidRequestError("prompt_token_ids", "id 5000 outside [0, 1024)")

    with pytest.raises(InvalidRequestError) as info:
        messages.unwrap(Reservation, messages.reply(invalid))
    assert info.value.field == "prompt_token_ids"
    assert str(info.value) == "prompt_token_ids: id 5000 outside [0, 1024)"
    for error in (CapacityError("full"), TransferError("link down")):
        with pytest.raises(type(error), match=str(error)):
            messages.unwrap(None, messages.reply_error(error))
    with pytest.raises(messages.WorkerError, match="ZeroDivisionError"):
        messages.unwrap(None, messages.reply_error(ZeroDivisionError("x")))


def test_a_prefill_handoff_reads_back_from_its_bytes_and_refuses_others():
    handoff = PrefillHandoff(TokenLogprobs(-1.5), StageTimes(prefill_s=0.5))
    assert PrefillHandoff.from_bytes(handoff.to_bytes()) == handoff
    assert PrefillHandoff.from_bytes(b"") == PrefillHandoff()  # a sender that sent none
    assert PrefillHandoff.from_bytes(msgpack.packb({"logprobs": None})) == PrefillHandoff()
    for garbage in (b"\xc1", msgpack.packb(7), msgpack.packb({"hidden": 1}), b"\x81\xa1"):
        with pytest.raises(TransferError, match="unreadable prefill handoff"):
            PrefillHandoff.from_bytes(garbage)


def test_spec_counts_add_up_and_give_the_mean_accepted_length():
    assert SpecCounts.total([None, None]) is None
    total = SpecCounts.total([SpecCounts(4, 1, 2), None, SpecCounts(6, 5, 3)])
    assert total == SpecCounts(10, 6, 5)
    assert total.mean_accepted_length == 1.0 + 6 / 5
    assert SpecCounts(0, 0, 0).mean_accepted_length == 1.0
