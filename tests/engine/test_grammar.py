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
    result = RankResult(3, [], [1, 2, 3], row_errors={"a": "structured output failed: x"})
    assert result_from_wire(result_to_wire(result)) == result


def test_the_constraint_travels_in_the_workers_messages():
    from pdserve.engine.messages import decode, encode

    params = SamplingParams(max_tokens=9, structured=CHOICE)
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
