"""`pdserve eval`'s parts that need no server: the built-in task, answer extraction, and task files that are
refused naming what is wrong. The evaluation through a running server is in test_openai_http.py."""

from __future__ import annotations

import json

import pytest

from pdserve.cli.evaluate import (
    STOP,
    completion_prompt,
    extract_flexible,
    extract_strict,
    load_task,
)
from pdserve.cli.main import main
from pdserve.model.errors import ConfigError


def test_builtin_task_has_twenty_items_with_numeric_targets():
    task = load_task("gsm8k-mini")
    assert task.name == "gsm8k-mini" and len(task.test) == 20 and len(task.fewshot) == 3
    assert len(task.sha256) == 64
    for item in task.test + task.fewshot:
        assert item.target.lstrip("-").isdigit()
        # The prompt's own answers must not end the completion early.
        assert not any(stop in item.question for stop in STOP)
    prompt = completion_prompt(task, task.test[0], 2)
    assert prompt.count("Question:") == 3 and prompt.endswith("Answer:")
    assert task.fewshot[1].answer in prompt and task.fewshot[2].answer not in prompt


@pytest.mark.parametrize(
    ("response", "strict", "flexible"),
    [
        (" 3 + 4 = 7.\n#### 7", "7", "7"),
        (" It costs $1,200.", None, "1200"),
        ("#### 18.0 then 5", "18", "5"),
        ("2.5 apples", None, "2.5"),
        ("no number here", None, None),
        ("#### -4", "-4", "-4"),
    ],
)
def test_answers_are_extracted_strictly_and_flexibly(response, strict, flexible):
    assert (extract_strict(response), extract_flexible(response)) == (strict, flexible)


@pytest.mark.parametrize(
    ("doc", "names"),
    [
        ({"test": []}, "'test' is empty"),
        ({"test": [{"question": "q"}]}, "test[0] must be an object"),
        ({"test": [{"question": "q", "answer": "no marker"}]}, "test[0]: the answer must end"),
        (
            {"test": [{"question": "q", "answer": "#### 1"}], "fewshot": {}},
            "'fewshot' must be a list",
        ),
        ([1, 2], "expected an object"),
    ],
)
def test_bad_task_files_are_refused_naming_the_problem(tmp_path, doc, names):
    path = tmp_path / "task.json"
    path.write_text(json.dumps(doc))
    with pytest.raises(ConfigError, match=str(path)) as e:
        load_task(str(path))
    assert names in str(e.value)


def test_missing_task_and_bad_flags_fail_with_one_line(tmp_path, capsys):
    assert main(["eval", "--task", str(tmp_path / "absent.json")]) == 2
    assert "neither a built-in task" in capsys.readouterr().err
    assert main(["eval", "--num-fewshot", "4"]) == 2
    assert "task gsm8k-mini has 3 few-shot examples" in capsys.readouterr().err
    assert main(["eval", "--concurrency", "0"]) == 2
    assert "--concurrency 0: must be at least 1" in capsys.readouterr().err


def test_unreachable_server_is_reported(capsys):
    assert main(["eval", "--base-url", "http://127.0.0.1:9/v1", "--limit", "1"]) == 2
    assert "is `pdserve serve` running" in capsys.readouterr().err
