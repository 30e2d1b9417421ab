"""The decode scheduler on its own (pure Python, no model): admission, KV arrival, continuous batching, stop rules,
preemption order and page accounting."""

from __future__ import annotations

import subprocess
import sys

import pytest

from pdserve.decode.scheduler import DecodeScheduler, RequestState
from pdserve.engine.messages import DecodeRequest
from pdserve.model.errors import CapacityError, InvalidRequestError
from pdserve.model.pages import PageAllocator
from pdserve.model.sampling_params import SamplingParams

PAGE = 4


def scheduler(num_pages=16, max_running=8) -> DecodeScheduler:
    return DecodeScheduler(PageAllocator(num_pages), PAGE, max_running, 64, 16, 100, 1000, {1})


def request(rid, n, max_tokens=8, peer="p0", **kw) -> DecodeRequest:
    params = SamplingParams(max_tokens=max_tokens, seed=0, **kw)
    return DecodeRequest(rid, list(range(3, 3 + n)), params, peer)


def test_schedulers_import_without_torch():
    code = (
        "import sys; sys.modules['torch'] = None\n"
        "import pdserve.decode.scheduler, pdserve.prefill.scheduler, pdserve.model.pages\n"
        "assert 'torch' not in [m for m, v in sys.modules.items() if v is not None]\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def test_admission_kv_arrival_and_decode_until_length():
    s = scheduler()
    seq = s.admit(request("a", 5, max_tokens=3))
    assert seq.state is RequestState.WAITING_FOR_KV and len(seq.pages) == 2
    assert s.schedule().decode == []  # nothing runs before its KV arrives
    (out,) = s.kv_arrived(seq.transfer_id, 5, first_token=42)
    assert out.token_ids == [42] and out.finish_reason is None
    plan = s.schedule()
    assert plan.decode == [seq] and len(seq.pages) == 2  # 6 tokens fit 2 pages of 4
    assert s.decode_done(plan.decode, [43])[0].finish_reason is None
    plan = s.schedule()
    assert len(seq.pages) == 2
    (out,) = s.decode_done(plan.decode, [44])
    assert out.finish_reason == "length" and s.allocator.num_used == 0


def test_eos_on_first_token_finishes_at_arrival():
    s = scheduler()
    seq = s.admit(request("a", 3))
    (out,) = s.kv_arrived(seq.transfer_id, 3, first_token=1)
    assert out.finish_reason == "stop" and s.allocator.num_used == 0


def test_kv_for_the_wrong_token_count_aborts():
    s = scheduler()
    seq = s.admit(request("a", 3))
    (out,) = s.kv_arrived(seq.transfer_id, 4, first_token=5)
    assert out.finish_reason == "abort" and "4 tokens" in out.error and s.allocator.num_used == 0


def test_validation_and_capacity():
    s = scheduler(num_pages=4, max_running=2)
    with pytest.raises(InvalidRequestError) as e:
        s.admit(request("a", 0))
    assert str(e.value) == "prompt_token_ids: is empty"
    with pytest.raises(InvalidRequestError) as e:
        s.admit(DecodeRequest("b", [5, 200], SamplingParams(seed=0), "p0"))
    assert e.value.field == "prompt_token_ids"
    with pytest.raises(CapacityError):  # 17 + 8 tokens can never fit 4 pages of 4
        s.admit(request("c", 17))
    s.admit(request("d", 8))
    s.admit(request("e", 4))
    with pytest.raises(CapacityError):  # pages all taken right now
        s.admit(request("f", 4))
    with pytest.raises(InvalidRequestError) as e:
        s.admit(request("d", 1))
    assert e.value.field == "request_id"


def run_until_preemption(s: DecodeScheduler, token: int = 20):
    """Decode steps until one plan preempts something; returns that plan."""
    before = s.num_preemptions
    for _ in range(50):
        plan = s.schedule()
        if s.num_preemptions > before:
            return plan
        s.decode_done(plan.decode, [token] * len(plan.decode))
    raise AssertionError("no preemption")


def test_preemption_takes_the_newest_and_reports_it():
    s = scheduler(num_pages=6)  # 24 tokens: each request alone fits, both together do not
    old = s.admit(request("old", 4, max_tokens=20))
    new = s.admit(request("new", 4, max_tokens=20))
    s.kv_arrived(old.transfer_id, 4, 10)
    s.kv_arrived(new.transfer_id, 4, 11)
    plan = run_until_preemption(s)
    assert plan.decode == [old]
    (out,) = plan.outputs
    assert out.request_id == "new" and out.preempted and "new" not in s.seqs
    assert len(old.pages) == 4 and s.allocator.num_used == 4


def test_local_prefill_preemption_requeues_without_output():
    s = scheduler(num_pages=6)
    a = s.admit(request("a", 4, max_tokens=20, peer=None))
    b = s.admit(request("b", 4, max_tokens=20, peer=None))
    plan = s.schedule()
    assert [(c[0], c[1], c[2]) for c in plan.prefill] == [(a, 0, 4), (b, 0, 4)]
    assert s.prefill_done(a, 0, 4, 50)[0].token_ids == [50]
    assert s.prefill_done(b, 0, 4, 60)[0].token_ids == [60]
    plan = run_until_preemption(s)
    assert plan.decode == [a] and plan.outputs == [] and b.state is RequestState.PREFILLING
    assert not b.pages and not s.can_admit(1), "a preempted request goes before new ones"
    generated = b.num_generated
    s.abort("a")
    plan = s.schedule()  # b is back: prompt and generated tokens prefilled again
    assert [(c[0], c[1], c[2]) for c in plan.prefill] == [(b, 0, 4 + generated)]


def test_abort_frees_pages_in_every_state():
    s = scheduler()
    waiting = s.admit(request("w", 5))
    running = s.admit(request("r", 5))
    s.kv_arrived(running.transfer_id, 5, 9)
    s.schedule()
    for rid in ("w", "r"):
        (out,) = s.abort(rid)
        assert out.finish_reason == "abort"
    assert s.allocator.num_used == 0 and s.kv_arrived(waiting.transfer_id, 5, 9) == []
