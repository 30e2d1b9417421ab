"""Everything Ray: placement of pools, actor shells, the gRPC router, admin and scaling, and the `pdserve` CLI.

Public surface (imported from the modules, so that `pdserve generate` does not pay for torch and Ray):
`config.ServeConfig` and its sections, `config.build_config`; `server.PdServer`, `server.ServerThread`,
`server.connect_ray`; `client.Client`, `client.generate_request`.

| module | its one job |
|---|---|
| `config` | the frozen config dataclasses, YAML and flag loading |
| `placement` | where a worker goes (pure functions over resource tables) |
| `rank_actors` | a worker's rank processes as Ray actors on its placement group's bundles |
| `actors` | Ray actor shells around PrefillWorker / DecodeWorker (plain classes) |
| `pools` | `ray.remote`, placing and stopping one worker; `WorkerHandle` |
| `router` | a request's flow: admission, dispatch, relay, preemption, cleanup |
| `scaling` | starting, warming up, draining and stopping workers |
| `validation` | a request -> prompt ids + SamplingParams (checks both front ends share), errors naming the field |
| `errors` | exceptions -> gRPC status codes, and HTTP statuses in OpenAI's error shape |
| `engine_client` | the one interface the front ends use: submit and stream, cancel, health, status, scale |
| `service` | the thin gRPC servicers |
| `openai_api`, `chat_template`, `reasoning` | OpenAI's JSON shapes, chat templates (as transformers), `<think>` split |
| `http_server` | the OpenAI-compatible HTTP front end (Starlette on uvicorn, on the router's loop) |
| `server` | the serving process: Ray, KV store, gRPC server, health, reflection, logs |
| `reaper` | the watchdog that ends a local Ray with the process that started it, `kill -9` included |
| `client`, `commands`, `cli`, `demo` | the client library and the command line |
"""
