"""The structured-output target: `json_schema` outputs of the random tiny model parse and validate for 1,000
generated schemas (benchmarks/_schemas.py), 100%. Only the grammar mask can make a random model's text
valid JSON, let alone valid against the schema.

    python benchmarks/structured_schemas.py [--url http://127.0.0.1:PORT/v1] [--count 1000] [--concurrency 32]

Without --url it serves `--model` (default: the tiny model) itself (`pdserve serve`, one decode worker, in a
child process). Sends each schema as a chat request with `response_format: json_schema` (temperature 1, the
schema's number as the seed) through the official openai client, and reports how many parse, how many
validate, and the failures."""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _schemas import random_schema, validate  # noqa: E402


def check_all(url: str, count: int, concurrency: int, max_tokens: int) -> int:
    import openai

    client = openai.OpenAI(base_url=url, api_key="unused", max_retries=0, timeout=600)
    model = client.models.list().data[0].id

    def one(seed: int) -> str | None:
        schema = random_schema(seed)
        reply = client.chat.completions.create(
            model=model, messages=[{"role": "user", "content": "Fill in the form."}],
            max_tokens=max_tokens, temperature=1.0, seed=seed,
            response_format={"type": "json_schema", "json_schema": {"name": "form", "schema": schema}},
        )  # fmt: skip
        text = reply.choices[0].message.content
        try:
            instance = json.loads(text)
        except ValueError as e:
            return f"schema {seed}: does not parse ({e}; finish {reply.choices[0].finish_reason}): {text!r:.200}"
        try:
            validate(instance, schema)
        except ValueError as e:
            return f"schema {seed}: does not validate ({e}): {text!r:.200}"
        return None

    start = time.perf_counter()
    with ThreadPoolExecutor(concurrency) as pool:
        failures = [f for f in pool.map(one, range(count)) if f is not None]
    for failure in failures[:20]:
        print(failure)
    print(
        f"{count - len(failures)}/{count} json_schema outputs parse and validate "
        f"({100 * (count - len(failures)) / count:.1f}%), {time.perf_counter() - start:.0f} s"
    )
    return len(failures)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument(
        "--url", help="an OpenAI base URL (…/v1); default: serve the tiny model here"
    )
    parser.add_argument("--model", default="tiny", help="what to serve without --url")
    parser.add_argument("--count", type=int, default=1000)
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument("--max-tokens", type=int, default=600)
    args = parser.parse_args()
    if args.url:
        sys.exit(1 if check_all(args.url, args.count, args.concurrency, args.max_tokens) else 0)
    from _serve import Served

    with tempfile.TemporaryDirectory() as tmp:
        served = Served(args.model, Path(tmp) / "serve.log", [])
        try:
            failed = check_all(served.http_url, args.count, args.concurrency, args.max_tokens)
        finally:
            served.stop()
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
