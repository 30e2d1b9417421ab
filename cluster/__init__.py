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
| `validation` | GenerateRequest -> prompt ids + SamplingParams, or INVALID_ARGUMENT naming the field |
| `errors` | exceptions -> gRPC status codes |
| `service` | the thin gRPC servicers |
| `server` | the serving process: Ray, KV store, gRPC server, health, reflection, logs |
| `reaper` | the watchdog that ends a local Ray with the process that started it, `kill -9` included |
| `client`, `commands`, `cli`, `demo` | the client library and the command line |
"""
