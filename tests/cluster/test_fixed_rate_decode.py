"""The benchmark-only fixed-rate decode worker (`cluster.benchmark_fake_decode_ms`) as a plain class: outputs on
the tick grid with the tick's symbol, the request's length honoured, aborts and stats; and the config refusing it
beside prefill workers."""

from __future__ import annotations

import time

import pytest

from pdserve.cluster.config import ModelConfig, build_config
from pdserve.cluster.fixed_rate_decode import SYMBOLS, FixedRateDecodeShell, symbol_token_ids
from pdserve.engine import messages
from pdserve.engine.messages import DecodePoll, DecodeRequest, DecodeStats, Reservation
from pdserve.engine.sampling_params import SamplingParams
from pdserve.model.errors import CheckpointError, ConfigError

INTERVAL_MS = 20.0


@pytest.fixture(scope="module")
def model_path(model_dir):
    return str(model_dir)


def test_config_refuses_it_with_prefill_workers_and_bad_values():
    with pytest.raises(ConfigError, match="benchmark_fake_decode_ms=5.0 .* needs num_prefill=0"):
        build_config(None, {"cluster": {"benchmark_fake_decode_ms": 5.0}})
    with pytest.raises(ConfigError, match="benchmark_fake_decode_tokens=0"):
        build_config(
            None,
            {"cluster": {"num_prefill": 0, "benchmark_fake_decode_tokens": 0}},
        )
    config = build_config(None, {"cluster": {"num_prefill": 0, "benchmark_fake_decode_ms": 5.0}})
    assert config.cluster.benchmark_fake_decode_ms == 5.0


def test_emits_the_ticks_symbol_on_the_grid_until_max_tokens(model_path):
    symbols = symbol_token_ids(model_path)
    shell = FixedRateDecodeShell("decode-0", ModelConfig(path=model_path), INTERVAL_MS, 3)
    interval_s = INTERVAL_MS / 1e3
    try:
        assert messages.unwrap(dict, shell.ready())["num_pages"] > 0
        request = DecodeRequest("r1", [0, 5, 6], SamplingParams(max_tokens=8))
        added_at = time.monotonic()
        reservation = messages.unwrap(Reservation, shell.add_request(messages.encode(request)))
        assert reservation.num_pages == 1
        outputs = []
        give_up = time.monotonic() + 10
        while not (outputs and outputs[-1][1].finish_reason) and time.monotonic() < give_up:
            batch = messages.decode(DecodePoll, shell.poll_outputs(1.0)).outputs
            outputs += [(time.monotonic(), out) for out in batch]
        # 8 tokens, 3 a tick: 3 + 3 + 2, the last with finish reason length.
        assert [len(o.token_ids) for _, o in outputs] == [3, 3, 2]
        assert [o.finish_reason for _, o in outputs] == [None, None, "length"]
        ticks = []
        for received, out in outputs:
            (token,) = set(out.token_ids)
            # The tick it came from: the latest grid time before it was received, with its symbol.
            tick = int(received // interval_s)
            tick -= (tick - symbols.index(token)) % len(SYMBOLS)
            ticks.append(tick)
        # Later ticks than the one running when the request came (a late emitter skips ticks, never repeats).
        assert ticks == sorted(set(ticks)) and ticks[0] * interval_s > added_at - interval_s
        stats = messages.unwrap(DecodeStats, shell.stats())
        assert (stats.num_running, stats.pages_used) == (0, 0)
    finally:
        shell.close()


def test_abort_stops_a_request_and_frees_its_pages(model_path):
    shell = FixedRateDecodeShell("decode-0", ModelConfig(path=model_path), INTERVAL_MS, 1)
    try:
        request = DecodeRequest("r1", [0], SamplingParams(max_tokens=10_000))
        messages.unwrap(Reservation, shell.add_request(messages.encode(request)))
        assert messages.decode(DecodePoll, shell.poll_outputs(1.0)).outputs
        assert messages.unwrap(DecodeStats, shell.stats()).num_running == 1
        messages.unwrap(None, shell.abort("r1"))
        stats = messages.unwrap(DecodeStats, shell.stats())
        assert (stats.num_running, stats.pages_used) == (0, 0)
        shell.poll_outputs(0.0)  # what was emitted before the abort
        time.sleep(3 * INTERVAL_MS / 1e3)
        assert messages.decode(DecodePoll, shell.poll_outputs(0.0)).outputs == []
    finally:
        shell.close()


def test_a_checkpoint_without_a_tokenizer_fails_ready_and_emits_nothing(tmp_path):
    shell = FixedRateDecodeShell("decode-0", ModelConfig(path=str(tmp_path)), INTERVAL_MS, 1)
    try:
        with pytest.raises(CheckpointError, match="tokenizer.json: missing"):
            messages.unwrap(dict, shell.ready())
        assert not shell._thread.is_alive()
    finally:
        shell.close()
