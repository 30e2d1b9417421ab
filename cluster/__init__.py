"""The Ray side: placement of pools and of a worker's ranks, the actor shells, the router and its admission,
the supervisor and scaling, and the serve configuration every part is built from.

Public surface (imported from the modules, so that importing the config does not pay for torch and Ray):
`config.ServeConfig` and its sections, `config.build_config`.

| module | its one job |
|---|---|
| `config` | the frozen config dataclasses, YAML and flag loading |
| `prefix_routing` | the router's index of the workers' cached prefixes, and the choice by expected hit and load |
| `config_keys` | a config section's keys from its dataclass: types, docstrings, values checked |
| `placement` | where a worker goes (pure functions over resource tables) |
| `rank_actors` | a worker's rank processes as Ray actors on its placement group's bundles |
| `actors` | Ray actor shells around PrefillWorker / DecodeWorker (plain classes) |
| `fixed_rate_decode` | a benchmark-only decode actor that runs no model |
| `pools` | `ray.remote`, placing and stopping one worker; `WorkerHandle` |
| `router` | a request's flow: dispatch, relay, preemption, migration, cleanup |
| `admission` | where a request runs and when there is room for it (an object the router owns) |
| `request` | the router's record of one request in flight (router and admission share it) |
| `scaling` | starting, warming up, draining and stopping workers |
| `supervisor` | replacing lost workers |
| `ray_connect` | joining Ray, or starting the local one on loopback; what counts as loopback |
| `reaper` | the watchdog that ends a local Ray with the process that started it, `kill -9` included |
| `errors` | the errors the Ray side raises (the front ends map them to statuses) |
"""
