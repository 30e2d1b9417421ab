"""The serving runtime every worker runs. `plan`: the memory plan of a worker's layout (per rank: weights by group,
activation and workspace reserve, KV capacity), computed from the model's arguments alone, without GPUs;
`rank_memory`: the per-rank weight and reserve arithmetic it is made of. `rank_group`: a worker's driver and its
rank processes (`rank_process`), joined by one torch.distributed group, talking over a `plan_channel` (shared
memory, `shm_channel`, or gloo, `dist_channel`)."""
