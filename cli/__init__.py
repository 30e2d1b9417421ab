"""The `pdserve` command line and the small gRPC client its commands use.

| module | its one job |
|---|---|
| `main` | the parser and dispatch of every subcommand; one-line errors, exit code 2 |
| `commands` | serve, generate, status, scale, drain, demo, make-checkpoint, offline |
| `plan` | `pdserve plan`: a worker layout's per-rank memory plan, without GPUs |
| `evaluate` | `pdserve eval`: a GSM8K-style evaluation through the HTTP API (`data/`: the built-in task) |
| `demo` | `pdserve demo`: the embedded default end to end |
| `client` | a synchronous client of the gRPC API (`Client`, `generate_request`) |
"""
