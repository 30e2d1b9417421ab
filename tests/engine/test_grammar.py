"""The constraint path without a model: checking a constraint, the runner's matchers and masks on the tiny
model's tokenizer, the batched mask leaving unconstrained rows' samples alone, a grammar that allows no token
failing its request alone, the constraint on the rank wire, and constrained requests verifying no drafts."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch

from pdserve.engine.grammar import check, constrain_json
from pdserve.engine.grammar_masks import GrammarMatchers
from pdserve.engine.ranks.wire import plan_from_wire, plan_to_wire, result_from_wire, result_to_wire
from pdserve.engine.sampler import sample
from pdserve.engine.sampling_params import SamplingParams, StructuredOutput
from pdserve.engine.step import DecodeRow, RankResult, RankStep, SampleSpec, StepPlan
from pdserve.model.errors import InvalidRequestError
from pdserve.model.tokenizer import THINK_END, TOOL_CALL_END, Tokenizer

CHOICE = StructuredOutput("choice", json.dumps(["yes", "no"]))
SCHEMA = {
    "type": "object",
    "properties": {
        "a": {"type": "integer", "minimum": 0, "maximum": 999},
        "b": {"enum": ["x", "yz"]},
    },
    "required": ["a", "b"],
    "additionalProperties": False,
}


@pytest.fixture(scope="module")
def matchers(model_dir):
    return GrammarMatchers(Path(model_dir) / "tokenizer.json", 1024, [1])


@pytest.fixture(scope="module")
def tokenizer(model_dir):
    return Tokenizer(model_dir)


def spec(step: int = 0, structured: StructuredOutput | None = CHOICE, temperature: float = 1.0):
    params = SamplingParams(max_tokens=50, temperature=temperature, seed=7, structured=structured)
    return SampleSpec.of(params, step)


def allowed(masks, row: int, vocab: int = 1024) -> set[int]:
    bits = (masks.bitmask[row][:, None] >> torch.arange(32, dtype=torch.int32)) & 1
    return set(bits.flatten()[:vocab].nonzero().flatten().tolist())


def test_check_names_the_field_and_constrain_json_sets_the_schema():
    with pytest.raises(InvalidRequestError, match="where.it.was: .*Invalid type"):
        check(StructuredOutput("json_schema", '{"type": "objet"}'), "where.it.was")
    with pytest.raises(InvalidRequestError, match="args"):
        check(StructuredOutput("regex", "[a-"), "args")
    params = constrain_json(SamplingParams(), {"type": "object"}, "tools[0].parameters")
    assert params.structured == StructuredOutput("json_schema", '{"type": "object"}')
    with pytest.raises(InvalidRequestError, match="constrained already"):
        constrain_json(params, {"type": "object"}, "tools[0].parameters")
    with pytest.raises(InvalidRequestError, match="ignore_eos"):
        SamplingParams(ignore_eos=True, structured=CHOICE)


def test_masks_follow_the_grammar_to_its_end(matchers, tokenizer):
    first = spec()
    assert first.grammar == CHOICE and first.constrained and not first.plain
    masks, errors = matchers.masks(["a"], [first], torch.device("cpu"))
    assert not errors and masks.row_ids == (0,)
    texts = {tokenizer.decode([t]) for t in allowed(masks, 0)}
    assert texts and all("yes".startswith(t) or "no".startswith(t) for t in texts)
    tokens = tokenizer.encode("yes", add_bos=False)
    later = SampleSpec.of(SamplingParams(structured=CHOICE), 1, counted=True)
    assert later.grammar is None and later.constrained
    matchers.accept(["a"], [first], tokens[:1], errors)
    for t in tokens[1:]:
        masks, errors = matchers.masks(["a"], [later], torch.device("cpu"))
        matchers.accept(["a"], [later], [t], errors)
    masks, errors = matchers.masks(["a"], [later], torch.device("cpu"))
    assert not errors and allowed(masks, 0) == {1}  # only EOS once "yes" is complete
    # a runner taking the request over starts from its generated tokens
    moved = SampleSpec.of(SamplingParams(structured=CHOICE), len(tokens), [0, 5, *tokens])
    assert moved.grammar_ids == tuple(tokens)
    masks, errors = matchers.masks(["b"], [moved], torch.device("cpu"))
    assert not errors and allowed(masks, 0) == {1}
    matchers.keep({"b"})
    assert len(matchers) == 1


def test_the_mask_leaves_unconstrained_rows_alone(matchers):
    torch.manual_seed(0)
    logits = torch.randn(4, 1024)
    specs = [spec(structured=None), spec(), spec(structured=None, temperature=0), spec()]
    ids = ["u0", "c1", "u2", "c3"]
    masks, errors = matchers.masks(ids, specs, torch.device("cpu"))
    assert not errors and masks.row_ids == (1, 3)
    alone, _ = sample(logits[[0, 2]], [specs[0], specs[2]], ["u0", "u2"])
    tokens, _ = sample(logits, specs, ids, masks=masks)
    assert [tokens[0], tokens[2]] == alone
    assert tokens[1] in allowed(masks, 0) and tokens[3] in allowed(masks, 1)


def test_a_grammar_that_allows_no_token_fails_its_request_alone(matchers):
    specs = [spec(), spec(structured=None)]
    masks, errors = matchers.masks(["bad", "ok"], specs, torch.device("cpu"))
    errors = {}
    matchers.accept(["bad", "ok"], specs, [2, 2], errors)  # token 2 (PAD) is never allowed
    assert list(errors) == ["bad"] and "refused" in errors["bad"]
    later = SampleSpec.of(SamplingParams(structured=CHOICE), 1, counted=True)
    _, errors = matchers.masks(["bad"], [later], torch.device("cpu"))
    assert "structured output failed" in errors["bad"]  # its matcher stays failed
    unknown = SampleSpec.of(SamplingParams(structured=CHOICE), 1, counted=True)
    _, errors = matchers.masks(["unknown"], [unknown], torch.device("cpu"))
    assert "no grammar matcher" in errors["unknown"]


def test_a_constraint_starting_after_a_token_leaves_the_rows_before_it_free(matchers, tokenizer):
    """`start_after`: every token is allowed (and taken) until the start token is sampled; the grammar masks
    from the next row, and a runner taking the request over resumes it from its generated tokens."""
    think_end = tokenizer.token_id(THINK_END)
    structured = StructuredOutput("choice", json.dumps(["yes", "no"]), start_after=think_end)
    params = SamplingParams(max_tokens=50, structured=structured)
    free = tokenizer.encode("maybe not", add_bos=False)  # not what the choice allows
    answer = tokenizer.encode("yes", add_bos=False)
    for step, token in enumerate([*free, think_end, *answer]):
        row = SampleSpec.of(params, step, counted=step > 0)
        masks, errors = matchers.masks(["w"], [row], torch.device("cpu"))
        assert not errors, errors
        if step <= len(free):
            assert len(allowed(masks, 0)) == 1024  # free up to and including the start token
        else:
            assert token in allowed(masks, 0) and len(allowed(masks, 0)) < 10
        matchers.accept(["w"], [row], [token], errors)
        assert not errors, errors
    masks, _ = matchers.masks(["w"], [SampleSpec.of(params, 9, counted=True)], torch.device("cpu"))
    assert allowed(masks, 0) == {1}
    generated = [*free, think_end, answer[0]]
    moved = SampleSpec.of(params, len(generated), [0, 5, *generated])
    masks, errors = matchers.masks(["w2"], [moved], torch.device("cpu"))
    assert not errors and allowed(masks, 0) == {answer[1]}
    still_free = SampleSpec.of(params, len(free), [0, 5, *free])
    masks, errors = matchers.masks(["w3"], [still_free], torch.device("cpu"))
    assert not errors and len(allowed(masks, 0)) == 1024


def test_a_verify_group_is_masked_from_the_row_after_a_drafted_start_token(matchers, tokenizer):
    think_end = tokenizer.token_id(THINK_END)
    structured = StructuredOutput("choice", json.dumps(["yes", "no"]), start_after=think_end)
    params = SamplingParams(max_tokens=50, structured=structured)
    masks, errors = matchers.masks(["v"], [SampleSpec.of(params, 0)], torch.device("cpu"))
    matchers.accept(["v"], [SampleSpec.of(params, 0)], [7], errors)
    yes = tokenizer.encode("yes", add_bos=False)
    later = [SampleSpec.of(params, 1 + k, counted=True) for k in range(4)]
    drafts = [[8, think_end, yes[0]], [], [], []]  # a group of four rows: the token, three drafts
    masks, errors = matchers.masks(["v"] * 4, later, torch.device("cpu"), drafts)
    assert not errors
    assert len(allowed(masks, 0)) == 1024 and len(allowed(masks, 1)) == 1024
    assert yes[0] in allowed(masks, 2) and len(allowed(masks, 2)) < 10  # after the start token
    assert allowed(masks, 3) == {yes[1]}  # as if the drafted "y" were taken
    # all four kept (the three drafts and a bonus token): the matcher is past "y", at the bonus token
    matchers.accept(
        ["v"] * 4, later, [8, think_end, yes[0], yes[1], 0, 0][:4], errors, [4, 0, 0, 0]
    )
    assert not errors
    masks, _ = matchers.masks(["v"], [SampleSpec.of(params, 5, counted=True)], torch.device("cpu"))
    assert allowed(masks, 0) == ({yes[2]} if len(yes) > 2 else {1})


def test_constraints_and_row_errors_cross_the_rank_wire():
    rows = [
        DecodeRow("a", 5, 9, [0], spec(2)),
        DecodeRow(
            "b", 6, 9, [1], SampleSpec.of(SamplingParams(structured=CHOICE), 3, counted=True)
        ),
        DecodeRow("c", 7, 9, [2], spec(structured=None)),
    ]
    plan = StepPlan(3, [RankStep(decode=rows)])
    got = plan_from_wire(plan_to_wire(plan))
    assert [r.sample for r in got.ranks[0].decode] == [r.sample for r in rows]
    waiting = StructuredOutput("regex", "[a-z]+", start_after=982)
    row = DecodeRow("d", 8, 9, [3], SampleSpec.of(SamplingParams(structured=waiting), 2, [5, 6]))
    got = plan_from_wire(plan_to_wire(StepPlan(4, [RankStep(decode=[row])])))
    assert got.ranks[0].decode[0].sample.grammar == waiting
    result = RankResult(3, [], [1, 2, 3], row_errors={"a": "structured output failed: x"})
    assert result_from_wire(result_to_wire(result)) == result


def test_the_constraint_travels_in_the_workers_messages():
    from pdserve.engine.messages import decode, encode

    for structured in (CHOICE, StructuredOutput("json_object", start_after=982)):
        params = SamplingParams(max_tokens=9, structured=structured)
        assert decode(SamplingParams, encode(params)) == params


def test_json_inside_a_grammar_is_compact_and_validated(matchers, tokenizer):
    from pdserve.engine.grammar import constrain, json_rule

    schema = {"type": "object", "properties": {"city": {"enum": ["Paris"]}}, "required": ["city"]}
    lark = 'start: "<call>" args "</call>"\nargs: ' + json_rule(schema)
    params = constrain(SamplingParams(), StructuredOutput("grammar", lark), "tools[0]")
    first = SampleSpec.of(params, 0)
    errors: dict[str, str] = {}
    for step, t in enumerate(tokenizer.encode('<call>{"city":"Paris"}</call>', add_bos=False)):
        row = first if step == 0 else SampleSpec.of(params, step, counted=True)
        _, errors = matchers.masks(["t"], [row], torch.device("cpu"))
        matchers.accept(["t"], [row], [t], errors)
        assert not errors, errors
    masks, _ = matchers.masks(["t"], [SampleSpec.of(params, 9, counted=True)], torch.device("cpu"))
    assert allowed(masks, 0) == {1}
    with pytest.raises(InvalidRequestError, match="tools"):
        constrain(params, StructuredOutput("json_object"), "tools[0]")


def drive(matchers, structured: StructuredOutput, request_id: str, pick=min) -> list[int]:
    """The tokens a request constrained to `structured` takes, `pick`ing one of the allowed ones each step
    until only EOS is allowed; fails on a row error."""
    params = SamplingParams(max_tokens=64, structured=structured)
    tokens: list[int] = []
    for step in range(64):
        row = SampleSpec.of(params, step, counted=step > 0)
        masks, errors = matchers.masks([request_id], [row], torch.device("cpu"))
        assert not errors, errors
        if allowed(masks, 0) == {1}:
            return tokens
        tokens.append(pick(allowed(masks, 0) - {1}))
        matchers.accept([request_id], [row], tokens[-1:], errors)
        assert not errors, errors
    raise AssertionError(f"no end after {tokens}")


@pytest.mark.parametrize(
    "structured, text",
    [
        (StructuredOutput("regex", "</think>"), "</think>"),
        (StructuredOutput("regex", "<think>[a-z]{3}</think>"), None),
        (StructuredOutput("json_schema", json.dumps({"const": "</think>"})), '"</think>"'),
        (StructuredOutput("json_schema", json.dumps({"enum": ["a<think>b"]})), '"a<think>b"'),
        (StructuredOutput("choice", json.dumps([TOOL_CALL_END])), TOOL_CALL_END),
        (StructuredOutput("grammar", f'start: "x" "{THINK_END}"'), "x</think>"),
    ],
)
def test_literals_spelling_an_added_token_are_generated(matchers, tokenizer, structured, text):
    """The text of an added token (`</think>`, a tool-call marker) that a grammar forces is generated and
    taken by the matcher (llguidance holds added tokens apart from text)."""
    got = tokenizer.decode(drive(matchers, structured, f"added-{structured.kind}"))
    if text is None:
        assert re.fullmatch(structured.text, got), got
    else:
        assert got == text


def test_a_choice_of_an_added_tokens_text_takes_that_token(matchers, tokenizer):
    think_end = tokenizer.token_id(THINK_END)
    choice = StructuredOutput("choice", json.dumps(["no", f"a{THINK_END}", THINK_END]))
    tokens = drive(
        matchers, choice, "added-token", pick=lambda a: think_end if think_end in a else max(a)
    )
    assert tokens == [think_end]
    tokens = drive(matchers, choice, "added-after-text", pick=lambda a: min(a - {think_end} or a))
    assert tokenizer.decode(tokens) == f"a{THINK_END}" and tokens[-1] == think_end


@pytest.mark.parametrize("acceptance", [0.7, 1.0])
def test_speculation_masks_each_verified_row_and_keeps_greedy_exact(
    reference_model, tokenizer, acceptance
):
    """Drafts of the known greedy continuation, some replaced by other tokens: the grammar masks every row
    of a verify group as if the drafts before it were taken, so the kept tokens are exactly the
    unspeculated ones, and a replaced draft the grammar refuses is rejected."""
    from pdserve.engine.drafter import OracleDrafter
    from pdserve.engine.offline import OfflineGenerator

    structured = check(StructuredOutput("json_schema", json.dumps(SCHEMA)), "s")
    params = SamplingParams(max_tokens=120, structured=structured)
    prompt = tokenizer.encode("JSON:")
    plain = OfflineGenerator(reference_model).generate(prompt, params)
    sequences = {"offline": [*prompt, *plain.token_ids]}
    speculating = OfflineGenerator(
        reference_model, num_drafts=2,
        drafter=lambda m, c: OracleDrafter(m, c, sequences, acceptance, seed=3),
    )  # fmt: skip
    got = speculating.generate(prompt, params)
    assert got.token_ids == plain.token_ids and got.finish_reason == "stop"
    assert got.num_accepted > 0 and got.num_steps < plain.num_steps
    json.loads(tokenizer.decode(got.token_ids))


def test_speculation_keeps_greedy_exact_where_the_constraint_starts_after_a_token(
    reference_model, tokenizer
):
    """A constraint that starts after a token the model reaches freely (a stand-in for a think block's end,
    which random weights seldom write): the output is the model's own up to that token, then parsing JSON,
    and drafts verified against the masks (the start token among them) keep exactly those tokens."""
    from pdserve.engine.drafter import OracleDrafter
    from pdserve.engine.offline import OfflineGenerator

    prompt = tokenizer.encode("JSON:")
    free = OfflineGenerator(reference_model).generate(prompt, SamplingParams(max_tokens=4))
    start = free.token_ids[2]
    upto = free.token_ids.index(start) + 1
    structured = StructuredOutput("json_schema", json.dumps(SCHEMA), start_after=start)
    params = SamplingParams(max_tokens=120, structured=check(structured, "s"))
    plain = OfflineGenerator(reference_model).generate(prompt, params)
    assert plain.token_ids[:upto] == free.token_ids[:upto] and plain.finish_reason == "stop"
    json.loads(tokenizer.decode(plain.token_ids[upto:]))
    sequences = {"offline": [*prompt, *plain.token_ids]}
    speculating = OfflineGenerator(
        reference_model, num_drafts=2,
        drafter=lambda m, c: OracleDrafter(m, c, sequences, 0.7, seed=3),
    )  # fmt: skip
    got = speculating.generate(prompt, params)
    assert got.token_ids == plain.token_ids and got.num_accepted > 0
