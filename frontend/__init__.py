"""The serving process's doors: the gRPC service and the OpenAI-compatible HTTP API, each a peer over one small
engine-client interface, with what they share (request building and validation, chat templates, the reasoning
split, tool calls, text streaming, security, metrics, the error -> status mapping) and the serving process
that hosts them.

Public surface (imported from the modules, so that a client does not pay for torch and Ray):
`server.PdServer`, `server.ServerThread`; `engine_client.EngineClient` (the front ends'
contract) and `ray_engine.RayEngineClient` (the serving process's implementation of it).

| module | its one job |
|---|---|
| `server` | the serving process: Ray, KV store, gRPC server, health, reflection, HTTP, pools, logs |
| `engine_client` | the one interface the front ends use: submit and stream, cancel, health, status, scale |
| `ray_engine` | that interface over the router, the scaler and the supervisor |
| `grpc_service` | the thin gRPC servicers (Generation, Admin) |
| `http_server` | the OpenAI-compatible HTTP front end (Starlette on uvicorn, on the router's loop) |
| `http_protocol` | the HTTP connection: deadlines for headers, body and unread responses; lingering close |
| `openai_api` | OpenAI's request and response JSON shapes |
| `openai_fields` | the OpenAI parameters accepted and ignored, their header and once-per-name warning |
| `tokenizer_api` | vLLM's /tokenize, /detokenize and /tokenizer_info (harnesses that count tokens themselves) |
| `prompt_batch` | a completions request listing several prompts: read, bounded, one request each, choices merged |
| `echo` | the completions API's `echo` and vLLM's `prompt_logprobs`: each choice's prompt in front |
| `json_body` | a request body's JSON, decoded and checked (nesting depth, lone surrogates) |
| `request_builder` | a request in no protocol's shape -> the checked request (prompt ids, SamplingParams, stop, n) |
| `validation` | the checks both front ends' requests pass, errors naming the field as each protocol does |
| `chat_template` | chat messages -> prompt text, as transformers renders the checkpoint's template |
| `reasoning` | the `<think>` split of a reasoning model's text, starting where the prompt left off |
| `tool_request` | a chat request's `tools`, `tool_choice` checked; the plan: prompt, forced call, grammar constraint |
| `tool_format` | DeepSeek-V3's and V3.1's tool-call formats: detected from a template, tools described, calls forced |
| `structured_outputs` | a request body's structured-output fields (response_format, vLLM's) as one constraint |
| `tool_grammar` | the grammar a required or named tool call's output is masked to, so that its arguments parse |
| `tool_parser` | generated text -> OpenAI tool calls, whole or streamed, malformed blocks left as content |
| `chat_output` | a chat choice's text -> reasoning, content and tool calls (message or stream deltas) |
| `text_stream` | generated ids -> text deltas, stop strings across token boundaries |
| `security` | API and admin keys on both front ends, TLS material |
| `metrics` | Prometheus metrics in vLLM's names |
| `errors` | exceptions -> gRPC status codes, and HTTP statuses in OpenAI's error shape |
"""
