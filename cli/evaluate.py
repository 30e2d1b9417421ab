"""`pdserve eval`: a GSM8K-style evaluation through a running server's OpenAI-compatible HTTP API, from a task file
on disk (no download): each test question is sent as a greedy completion (or chat) request, few-shot when asked,
and the number the answer ends with is compared with the reference's.

A task file is one JSON document: `name`, `description`, `fewshot` and `test`, lists of
`{"question": str, "answer": str}` whose answer ends with `#### <number>` (GSM8K's convention). The built-in
`gsm8k-mini` (`cli/data/gsm8k_mini.json`, 20 test items) is the default.

The result (printed, and written by `--output`) is one JSON object, format `pdserve-eval/1`:

    {"format": "pdserve-eval/1", "task": "gsm8k-mini", "task_file": ..., "task_sha256": ...,
     "base_url": ..., "model": ..., "api": "completions" | "chat", "num_fewshot": 0, "max_tokens": 256,
     "num_items": 20, "num_errors": 0,
     "metrics": {"exact_match_strict":   {"score": 0.0-1.0, "num_correct": int, "stderr": float},
                 "exact_match_flexible": {...}},
     "score": <exact_match_flexible's score>, "elapsed_s": float, "date": "<UTC ISO 8601>",
     "samples": [{"index", "question", "target", "response", "finish_reason", "answer_strict",
                  "answer_flexible", "correct_strict", "correct_flexible", "error"}, ...]}

`exact_match_strict` reads only an answer written as `#### <number>`; `exact_match_flexible` takes the last number in
the response. A request that failed (`error` set, counted in `num_errors`) counts as wrong; `stderr` is the
standard error of the mean over items. The exit code is 1 when any request failed."""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import datetime
import hashlib
import json
import math
import os
import re
import sys
import threading
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from importlib import resources
from pathlib import Path

from pdserve.cluster.errors import UnavailableError
from pdserve.model.errors import ConfigError

FORMAT = "pdserve-eval/1"
BUILTIN_TASKS = {"gsm8k-mini": "gsm8k_mini.json"}
COMPLETIONS, CHAT = "completions", "chat"
STOP = ("Question:", "\n\n\n")
"""Where a completion's answer ends: the model starting the next few-shot question."""
_STRICT = re.compile(r"####\s*(-?[$0-9.,]+)")
_NUMBER = re.compile(r"-?[$0-9.,]*[0-9]")
_CONNECT_TIMEOUT_S = 10.0


@dataclasses.dataclass(frozen=True, slots=True)
class Item:
    question: str
    answer: str
    """The worked answer, ending with `#### <number>`."""

    @property
    def target(self) -> str:
        return normalize_number(_STRICT.search(self.answer).group(1))


@dataclasses.dataclass(frozen=True, slots=True)
class Task:
    name: str
    path: str
    sha256: str
    fewshot: list[Item]
    test: list[Item]


def normalize_number(text: str) -> str:
    """A number as written ("$1,200.", "18.0") in one canonical form ("1200", "18")."""
    text = text.replace(",", "").replace("$", "").rstrip(".")
    try:
        value = float(text)
    except ValueError:
        return text
    return str(int(value)) if value.is_integer() else repr(value)


def extract_strict(response: str) -> str | None:
    """The number after the response's first `####`, or None."""
    match = _STRICT.search(response)
    return normalize_number(match.group(1)) if match else None


def extract_flexible(response: str) -> str | None:
    """The last number in the response, or None."""
    numbers = _NUMBER.findall(response)
    return normalize_number(numbers[-1]) if numbers else None


def _items(values, path: str, key: str) -> list[Item]:
    if not isinstance(values, list):
        raise ConfigError(f"task file {path}: {key!r} must be a list of {{question, answer}}")
    items = []
    for i, value in enumerate(values):
        where = f"task file {path}: {key}[{i}]"
        if not isinstance(value, dict) or not all(
            isinstance(value.get(k), str) for k in ("question", "answer")
        ):
            raise ConfigError(f"{where} must be an object with string 'question' and 'answer'")
        if not _STRICT.search(value["answer"]):
            raise ConfigError(f"{where}: the answer must end with '#### <number>'")
        items.append(Item(value["question"], value["answer"]))
    return items


def load_task(name_or_path: str) -> Task:
    """A built-in task by name (`BUILTIN_TASKS`) or a task file; ConfigError names what is wrong with it."""
    if name_or_path in BUILTIN_TASKS:
        source = resources.files("pdserve.cli").joinpath("data", BUILTIN_TASKS[name_or_path])
        path = str(source)
        raw = source.read_bytes()
    else:
        path = name_or_path
        try:
            raw = Path(path).read_bytes()
        except OSError as e:
            raise ConfigError(
                f"task {path!r}: neither a built-in task ({', '.join(BUILTIN_TASKS)}) nor a readable "
                f"file ({e.strerror})"
            ) from None
    try:
        doc = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ConfigError(f"task file {path}: not valid JSON ({e})") from None
    if not isinstance(doc, dict):
        raise ConfigError(f"task file {path}: expected an object with 'fewshot' and 'test'")
    test = _items(doc.get("test"), path, "test")
    if not test:
        raise ConfigError(f"task file {path}: 'test' is empty")
    name = doc.get("name") if isinstance(doc.get("name"), str) else Path(path).stem
    fewshot = _items(doc.get("fewshot", []), path, "fewshot")
    return Task(name, path, hashlib.sha256(raw).hexdigest(), fewshot, test)


def completion_prompt(task: Task, item: Item, num_fewshot: int) -> str:
    shots = "".join(
        f"Question: {s.question}\nAnswer: {s.answer}\n\n" for s in task.fewshot[:num_fewshot]
    )
    return f"{shots}Question: {item.question}\nAnswer:"


def chat_messages(task: Task, item: Item, num_fewshot: int) -> list[dict[str, str]]:
    messages = []
    for s in task.fewshot[:num_fewshot]:
        messages += [
            {"role": "user", "content": s.question},
            {"role": "assistant", "content": s.answer},
        ]
    return [*messages, {"role": "user", "content": item.question}]


class ApiClient:
    """Blocking JSON calls to an OpenAI-compatible API (stdlib only: the eval needs no client library)."""

    def __init__(self, base_url: str, api_key: str | None, timeout_s: float):
        self.base_url = base_url.rstrip("/")
        self.timeout_s = timeout_s
        self._headers = {"content-type": "application/json"}
        if api_key:
            self._headers["authorization"] = f"Bearer {api_key}"

    def call(self, path: str, body: dict | None = None, timeout_s: float | None = None) -> dict:
        """The response's JSON; raises RuntimeError with the server's error message on an HTTP error, and
        OSError when the server cannot be reached."""
        data = None if body is None else json.dumps(body).encode()
        request = urllib.request.Request(self.base_url + path, data=data, headers=self._headers)
        try:
            with urllib.request.urlopen(request, timeout=timeout_s or self.timeout_s) as response:
                return json.loads(response.read())
        except urllib.error.HTTPError as e:
            detail = e.read().decode(errors="replace")
            with contextlib.suppress(ValueError, KeyError, TypeError):  # not OpenAI's error shape
                detail = json.loads(detail)["error"]["message"]
            raise RuntimeError(f"HTTP {e.code}: {detail}") from None


def served_model(client: ApiClient) -> str:
    """The id of the first model /v1/models lists; UnavailableError when the server cannot be reached."""
    try:
        models = client.call("/models", timeout_s=_CONNECT_TIMEOUT_S)["data"]
    except (OSError, RuntimeError, KeyError) as e:
        raise UnavailableError(
            f"cannot list the models at {client.base_url}/models ({e}): is `pdserve serve` running "
            "with HTTP there? see --base-url"
        ) from None
    if not models:
        raise UnavailableError(f"{client.base_url}/models lists no model")
    return models[0]["id"]


def _ask(client: ApiClient, args, task: Task, item: Item, model: str) -> tuple[str, str]:
    """(response text, finish reason) for one item."""
    body = {"model": model, "max_tokens": args.max_tokens, "temperature": 0.0}
    if args.api == CHAT:
        body["messages"] = chat_messages(task, item, args.num_fewshot)
        reply = client.call("/chat/completions", body)["choices"][0]
        return reply["message"].get("content") or "", reply["finish_reason"]
    body.update(prompt=completion_prompt(task, item, args.num_fewshot), stop=list(STOP))
    reply = client.call("/completions", body)["choices"][0]
    return reply["text"], reply["finish_reason"]


def _metric(correct: list[bool]) -> dict:
    n, k = len(correct), sum(correct)
    score = k / n
    stderr = math.sqrt(score * (1 - score) / (n - 1)) if n > 1 else 0.0
    return {"score": score, "num_correct": k, "stderr": stderr}


def run_eval(args: argparse.Namespace, progress=None) -> dict:
    """Runs the evaluation `args` describe (see `add_eval_command`) and returns its result (module docstring);
    progress lines go to `progress`, by default the sys.stderr of the call (not of the import: a stream replaced
    since, as pytest replaces it per test, may be closed)."""
    progress = progress if progress is not None else sys.stderr
    task = load_task(args.task)
    if args.num_fewshot > len(task.fewshot):
        raise ConfigError(
            f"--num-fewshot {args.num_fewshot}: task {task.name} has {len(task.fewshot)} few-shot examples"
        )
    items = task.test[: args.limit] if args.limit else task.test
    client = ApiClient(
        args.base_url, args.api_key or os.environ.get("PDSERVE_API_KEY"), args.timeout
    )
    model = args.model or served_model(client)
    samples: list[dict | None] = [None] * len(items)
    done, lock, start = [0, 0], threading.Lock(), time.monotonic()

    def one(index: int) -> None:
        item = items[index]
        sample = {"index": index, "question": item.question, "target": item.target}
        try:
            response, finish_reason = _ask(client, args, task, item, model)
            error = ""
        except (OSError, RuntimeError, KeyError, IndexError) as e:
            response, finish_reason, error = "", None, str(e) or type(e).__name__
        strict, flexible = extract_strict(response), extract_flexible(response)
        sample.update(
            response=response, finish_reason=finish_reason, answer_strict=strict,
            answer_flexible=flexible, correct_strict=strict == item.target,
            correct_flexible=flexible == item.target, error=error,
        )  # fmt: skip
        samples[index] = sample
        with lock:
            done[0] += 1
            done[1] += sample["correct_flexible"]
            print(
                f"eval {task.name}: {done[0]}/{len(items)} done, {done[1]} correct"
                + (f" (item {index} failed: {error})" if error else ""),
                file=progress, flush=True,
            )  # fmt: skip

    with ThreadPoolExecutor(args.concurrency) as pool:
        list(pool.map(one, range(len(items))))
    flexible = _metric([s["correct_flexible"] for s in samples])
    return {
        "format": FORMAT,
        "task": task.name,
        "task_file": task.path,
        "task_sha256": task.sha256,
        "base_url": client.base_url,
        "model": model,
        "api": args.api,
        "num_fewshot": args.num_fewshot,
        "max_tokens": args.max_tokens,
        "num_items": len(items),
        "num_errors": sum(bool(s["error"]) for s in samples),
        "metrics": {
            "exact_match_strict": _metric([s["correct_strict"] for s in samples]),
            "exact_match_flexible": flexible,
        },
        "score": flexible["score"],
        "elapsed_s": time.monotonic() - start,
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "samples": samples,
    }


def add_eval_command(sub) -> None:
    p = sub.add_parser(
        "eval",
        help="score a running server on a GSM8K-style task through its OpenAI-compatible HTTP API",
        description=__doc__.split("\n\n")[0]
        + " Prints progress to stderr and the result (without its "
        "samples) to stdout; --output writes the whole result.",
    )
    p.add_argument(
        "--base-url",
        default="http://127.0.0.1:8000/v1",
        help="the API's base URL (default %(default)s)",
    )
    p.add_argument(
        "--task", default="gsm8k-mini",
        help=f"a built-in task ({', '.join(BUILTIN_TASKS)}) or a task file (default %(default)s)",
    )  # fmt: skip
    p.add_argument(
        "--api", default=COMPLETIONS, choices=[COMPLETIONS, CHAT],
        help="/v1/completions with a Question/Answer prompt (default), or /v1/chat/completions",
    )  # fmt: skip
    p.add_argument("--model", default=None, help="model id to ask for (default: the served one)")
    p.add_argument(
        "--num-fewshot", type=int, default=0, help="worked examples before each question"
    )
    p.add_argument("--max-tokens", type=int, default=256, help="longest answer, tokens")
    p.add_argument("--limit", type=int, default=None, help="only the first N test items")
    p.add_argument("--concurrency", type=int, default=8, help="requests in flight")
    p.add_argument("--timeout", type=float, default=600.0, help="per request, s")
    p.add_argument(
        "--api-key", default=None, help="sent as a bearer token (default: $PDSERVE_API_KEY if set)"
    )
    p.add_argument("--output", default=None, help="write the result JSON here")


def cmd_eval(args: argparse.Namespace) -> int:
    for flag, value, low in (
        ("--num-fewshot", args.num_fewshot, 0), ("--max-tokens", args.max_tokens, 1),
        ("--concurrency", args.concurrency, 1), ("--limit", 1 if args.limit is None else args.limit, 1),
    ):  # fmt: skip
        if value < low:
            raise ConfigError(f"{flag} {value}: must be at least {low}")
    result = run_eval(args)
    if args.output:
        Path(args.output).write_text(json.dumps(result, indent=2, ensure_ascii=False) + "\n")
    summary = {k: v for k, v in result.items() if k != "samples"}
    print(json.dumps(summary, indent=2))
    return 1 if result["num_errors"] else 0
