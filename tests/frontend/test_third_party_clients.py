"""The clients people already run, each as its own command against the shared tiny fp32 server's OpenAI HTTP API:
lm-eval's local-completions on small local tasks (multiple-choice log-likelihoods and a perplexity equal the
engine's own scoring of the same tokens within 1e-4, generate_until answers are the engine's greedy text), with
its tokenizer the server's (/tokenize) or the checkpoint's; lm-eval's local-chat-completions (answers in
`content`); guidellm and aiperf streaming with no errors.

They live in a virtualenv of their own (`make test-clients` makes it: their dependencies would double the test
environment), $PDSERVE_CLIENTS_VENV or `.venv-clients` at the repository root; a test whose client is not installed
there is skipped. Marked `clients` (`make test` leaves them out: each command starts in seconds of imports).
Nothing leaves the machine: tasks and datasets are local files, tokenizers the server's endpoints or its
checkpoint directory (each tool's flags for that are in `_env` and the commands)."""

from __future__ import annotations

import glob
import json
import os
import subprocess
from pathlib import Path

import pytest
from serving import engine_scoring

pytestmark = pytest.mark.clients

ROOT = Path(__file__).resolve().parents[2]
CLIENTS_VENV = Path(os.environ.get("PDSERVE_CLIENTS_VENV") or ROOT / ".venv-clients")
CLIENT_TIMEOUT_S = 300
"""One client command's limit: seconds of imports and worker processes on a loaded 2-core machine, then a few
dozen requests."""
SCORE_TOLERANCE = 1e-4


def client(name: str) -> Path:
    """The client's command in the clients' virtualenv."""
    return CLIENTS_VENV / "bin" / name


def needs(name: str) -> pytest.MarkDecorator:
    """Skips the test, before it starts anything, where `name` is not installed in the clients' virtualenv."""
    reason = f"{name} is not installed in {CLIENTS_VENV} (`make test-clients` installs it)"
    return pytest.mark.skipif(not client(name).is_file(), reason=reason)


def _env(tmp_path: Path, hub_offline: bool = True) -> dict[str, str]:
    """The clients' environment: Hugging Face caches in `tmp_path` (nothing from an earlier run is reused), hub
    and dataset access off, loopback never sent through a proxy, one thread each beside the server."""
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    env.update(
        HF_HOME=str(tmp_path / "hf"),
        HF_DATASETS_OFFLINE="1",
        HF_HUB_DISABLE_TELEMETRY="1",
        NO_PROXY="127.0.0.1,localhost",
        no_proxy="127.0.0.1,localhost",
        OMP_NUM_THREADS="1",
        TOKENIZERS_PARALLELISM="false",
    )
    if hub_offline:
        env["HF_HUB_OFFLINE"] = "1"
    else:  # aiperf: offline, it looks a local tokenizer path up in the hub's cache, and fails
        env.pop("HF_HUB_OFFLINE", None)
        env.pop("TRANSFORMERS_OFFLINE", None)
    return env


def run_client(argv: list, tmp_path: Path, hub_offline: bool = True) -> str:
    """Runs a client command to its end (killed past CLIENT_TIMEOUT_S); its output, or a failure showing its tail."""
    try:
        done = subprocess.run(
            [str(a) for a in argv], cwd=tmp_path, env=_env(tmp_path, hub_offline),
            stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
            timeout=CLIENT_TIMEOUT_S,
        )  # fmt: skip
    except subprocess.TimeoutExpired as e:
        tail = (e.output or "")[-4000:] if isinstance(e.output, str) else ""
        pytest.fail(f"{Path(argv[0]).name} ran past {CLIENT_TIMEOUT_S} s:\n{tail}")
    if done.returncode != 0:
        pytest.fail(f"{Path(argv[0]).name} exited {done.returncode}:\n{done.stdout[-6000:]}")
    return done.stdout


# lm-eval: tasks in YAML over local JSONL files (its `json` dataset builder reads them; no hub)

MC_DOCS = [
    {
        "question": "Which colour is the sky?",
        "choices": ["blue", "green", "a bright red"],
        "label": 0,
    },
    {"question": "How many legs has a cat?", "choices": ["four", "two"], "label": 0},
]
GEN_DOCS = [{"question": "Once upon a time", "answer": "there"},
            {"question": "The quick brown fox", "answer": "jumps"}]  # fmt: skip
GEN_TOKENS = 8
ROLL_DOCS = [{"text": "The quick brown fox jumps over the lazy dog."}, {"text": "Hello world"}]


def write_tasks(folder: Path) -> Path:
    """A multiple_choice task (`tiny_mc`), a generate_until task (`tiny_gen`) and a loglikelihood_rolling task
    (`tiny_roll`: a perplexity) over JSONL files in `folder`."""
    folder.mkdir()
    for name, docs in (("mc", MC_DOCS), ("gen", GEN_DOCS), ("roll", ROLL_DOCS)):
        (folder / f"{name}.jsonl").write_text("".join(json.dumps(d) + "\n" for d in docs))
    common = (
        "dataset_path: json\ndataset_kwargs:\n  data_files:\n    test: {path}\ntest_split: test\n"
    )
    (folder / "tiny_mc.yaml").write_text(
        "task: tiny_mc\n" + common.format(path=folder / "mc.jsonl")
        + "output_type: multiple_choice\n"
        'doc_to_text: "Question: {{question}}\\nAnswer:"\n'
        'doc_to_choice: "{{choices}}"\n'
        "doc_to_target: label\n"
        "metric_list:\n  - metric: acc\n    aggregation: mean\n    higher_is_better: true\n"
    )  # fmt: skip
    (folder / "tiny_gen.yaml").write_text(
        "task: tiny_gen\n" + common.format(path=folder / "gen.jsonl")
        + "output_type: generate_until\n"
        'doc_to_text: "{{question}}"\n'
        'doc_to_target: "{{answer}}"\n'
        f"generation_kwargs:\n  until: [\"\\n\"]\n  max_gen_toks: {GEN_TOKENS}\n"
        "metric_list:\n  - metric: exact_match\n    aggregation: mean\n    higher_is_better: true\n"
    )  # fmt: skip
    (folder / "tiny_roll.yaml").write_text(
        "task: tiny_roll\n" + common.format(path=folder / "roll.jsonl")
        + "output_type: loglikelihood_rolling\n"
        'doc_to_text: ""\n'
        'doc_to_target: "{{text}}"\n'
        "metric_list:\n  - metric: word_perplexity\n"
    )  # fmt: skip
    return folder


def lm_eval(tmp_path: Path, model_type: str, url: str, model: str, tasks: str, *extra) -> dict:
    """Runs lm-eval on the local tasks; {task: [sample, ...]} from its --log_samples files, doc order."""
    out = tmp_path / "out"
    run_client(
        [client("lm_eval"), "run", "--model", model_type,
         "--model_args", f"model={model},base_url={url},max_retries=1,num_concurrent=2,{extra[0]}",
         *extra[1:], "--include_path", write_tasks(tmp_path / "tasks"), "--tasks", tasks,
         "--output_path", out, "--log_samples"],
        tmp_path,
    )  # fmt: skip
    (results,) = glob.glob(f"{out}/**/results_*.json", recursive=True)
    assert set(json.loads(Path(results).read_text())["results"]) == set(tasks.split(","))
    samples = {}
    for task in tasks.split(","):
        (path,) = glob.glob(f"{out}/**/samples_{task}_*.jsonl", recursive=True)
        rows = [json.loads(line) for line in Path(path).read_text().splitlines()]
        samples[task] = sorted(rows, key=lambda r: r["doc_id"])
    return samples


def lm_eval_pair(tokenizer, context: str, continuation: str) -> tuple[list[int], list[int]]:
    """The token ids lm-eval's local-completions sends for a (context, continuation) pair: its `_encode_pair`
    (trailing spaces of the context move to the continuation; the whole is encoded and split at the context's
    length) with the Hugging Face tokenizer of the checkpoint and no special tokens (its add_bos_token=False)."""
    spaces = len(context) - len(context.rstrip())
    if spaces:
        context, continuation = context[:-spaces], context[-spaces:] + continuation
    whole = tokenizer.encode(context + continuation, add_bos=False)
    context_ids = tokenizer.encode(context, add_bos=False)
    return whole[: len(context_ids)], whole[len(context_ids) :]


# lm-eval's remote backend takes `bos_token_id or eos_token_id` as a window's prefix token: DeepSeek's BOS is id
# 0, so it would score perplexities after EOS; custom_prefix_token_id sets BOS, as its huggingface backend does.
BACKENDS = {
    "remote": "tokenizer_backend=remote,custom_prefix_token_id=0",
    "huggingface": "tokenizer_backend=huggingface",
}


@needs("lm_eval")
@pytest.mark.parametrize("backend", list(BACKENDS))
def test_lm_eval_local_completions_scores_as_the_engine_does(
    shared_server, model, tokenizer, reference_model, reference, backend, tmp_path
):
    """lm-eval tokenizing through the server's /tokenize (`remote`) or with the checkpoint directory's tokenizer
    (`huggingface`); batches of 2 (a list of prompts a request) on 2 connections."""
    url = f"{shared_server.http_url}/completions"
    samples = lm_eval(tmp_path, "local-completions", url, model, "tiny_mc,tiny_gen,tiny_roll",
                      f"tokenized_requests=True,{BACKENDS[backend]}", "--batch_size", "2")  # fmt: skip
    assert len(samples["tiny_mc"]) == len(MC_DOCS) and len(samples["tiny_gen"]) == len(GEN_DOCS)
    diffs = []
    for sample, doc in zip(samples["tiny_mc"], MC_DOCS, strict=True):
        assert len(sample["resps"]) == len(doc["choices"])
        for i, resp in enumerate(sample["resps"]):
            args = sample["arguments"][f"gen_args_{i}"]
            assert args["arg_1"] == " " + doc["choices"][i]
            (loglikelihood, is_greedy), = resp  # fmt: skip
            context, continuation = lm_eval_pair(tokenizer, args["arg_0"], args["arg_1"])
            scoring = engine_scoring(reference_model, context, continuation)
            want = sum(lp.logprob for lp in scoring)
            diffs.append(abs(float(loglikelihood) - want))
            assert float(loglikelihood) == pytest.approx(want, abs=SCORE_TOLERANCE)
            assert (is_greedy == "True") == all(lp.rank == 1 for lp in scoring)
    # loglikelihood_rolling: one window (the texts are short), BOS then the text, every text token scored
    for sample, doc in zip(samples["tiny_roll"], ROLL_DOCS, strict=True):
        (loglikelihood,), = sample["resps"]  # fmt: skip
        ids = tokenizer.encode(doc["text"], add_bos=False)
        want = sum(lp.logprob for lp in engine_scoring(reference_model, [tokenizer.bos_id], ids))
        diffs.append(abs(float(loglikelihood) - want))
        assert float(loglikelihood) == pytest.approx(want, abs=SCORE_TOLERANCE)
    print(f"lm-eval ({backend}): {len(diffs)} scores, largest |lm-eval - engine| {max(diffs):.2e}")
    # generate_until: greedy (lm-eval's temperature 0), cut at the first stop string
    for sample, doc in zip(samples["tiny_gen"], GEN_DOCS, strict=True):
        ids = tokenizer.encode(doc["question"], add_bos=False)
        want = tokenizer.decode(reference(ids, GEN_TOKENS)).split("\n")[0]
        assert sample["resps"] == [[want]]


@needs("lm_eval")
def test_lm_eval_local_chat_completions_answers_in_content(shared_server, model, tmp_path):
    url = f"{shared_server.http_url}/chat/completions"
    samples = lm_eval(tmp_path, "local-chat-completions", url, model, "tiny_gen",
                      "eos_string=<｜end▁of▁sentence｜>", "--apply_chat_template")  # fmt: skip
    answers = [sample["resps"][0][0] for sample in samples["tiny_gen"]]
    assert len(answers) == len(GEN_DOCS) and all(answers), answers


# guidellm and aiperf: synthetic prompts of a set token count, made with the checkpoint's tokenizer

NUM_REQUESTS = 8


@needs("guidellm")
@pytest.mark.parametrize("route", ["/v1/completions", "/v1/chat/completions"])
def test_guidellm_streaming_has_no_errors(shared_server, model, route, tmp_path):
    """guidellm streams with `stream_options.continuous_usage_stats` and counts tokens from the usage."""
    report = tmp_path / "guidellm.json"
    base = shared_server.http_url.removesuffix("/v1")
    run_client(
        [client("guidellm"), "run",
         "--backend", f"kind=openai_http,target={base},model={model},request_format={route},stream=true",
         "--profile", "kind=concurrent,streams=4",
         "--constraint", f"kind=max_requests,count={NUM_REQUESTS}",
         "--data", "kind=synthetic_text,prompt_tokens=32,output_tokens=8",
         "--output", f"kind=json,path={report}", "--disable-console"],
        tmp_path,
    )  # fmt: skip
    (benchmark,) = json.loads(report.read_text())["benchmarks"]
    totals = benchmark["metrics"]["request_totals"]
    assert totals == {"successful": NUM_REQUESTS, "errored": 0, "incomplete": 0,
                      "total": NUM_REQUESTS}  # fmt: skip
    for request in benchmark["requests"]["successful"]:
        args = json.loads(request["request_args"])  # guidellm writes them as a JSON string
        assert args["stream"] is True and args["body"]["stream_options"]["continuous_usage_stats"]
        assert request["output_tokens"] == 8  # from the server's usage (ignore_eos is sent)


@needs("aiperf")
@pytest.mark.parametrize("endpoint", ["completions", "chat"])
def test_aiperf_streaming_has_no_errors(shared_server, model, model_dir, endpoint, tmp_path):
    """aiperf with the checkpoint directory as its tokenizer. Its HF_HUB_OFFLINE mode cannot load a tokenizer
    from a local path (it looks the path up in the hub's cache), so it runs with the hub on; a local path never
    reaches the hub."""
    artifacts = tmp_path / "aiperf"
    base = shared_server.http_url.removesuffix("/v1")
    run_client(
        [client("aiperf"), "profile", "--model", model, "--url", base, "--endpoint-type", endpoint,
         "--streaming", "--tokenizer", model_dir, "--request-count", NUM_REQUESTS, "--concurrency", 4,
         "--isl", 32, "--osl", 8, "--extra-inputs", "ignore_eos:true", "--ui", "none",
         "--workers-max", 1, "--record-processors", 1, "--artifact-dir", artifacts],
        tmp_path, hub_offline=False,
    )  # fmt: skip
    report = json.loads((artifacts / "profile_export_aiperf.json").read_text())
    assert report["error_summary"] == [] and report["is_complete"] and not report["was_cancelled"]
    assert report["request_count"]["avg"] == NUM_REQUESTS
    assert report["usage_completion_tokens"]["avg"] == 8
