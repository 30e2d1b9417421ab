"""The serving runtime every worker runs. `plan`: the per-rank memory plan of a worker's layout (weights, activation
and workspace reserve, KV capacity), computed from the model's arguments alone, without GPUs."""
