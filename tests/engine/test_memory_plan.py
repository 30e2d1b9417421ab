"""The memory plan (`pdserve.engine.memory_plan`, `pdserve plan`): per-rank weights against the checkpoint's own bytes,
the layout's splits, the KV capacity and the refusals, on the CPU."""

from __future__ import annotations

import dataclasses
import json
import struct

import pytest
import torch

from pdserve.cli.main import _build_parser, main
from pdserve.cli.plan import layout_from_args
from pdserve.engine.memory_plan import MemoryPlanError, PlanSettings, model_for_plan, plan_memory
from pdserve.engine.rank_memory import GIB, GPU_MEMORY_UTILIZATION, weight_bytes_per_rank
from pdserve.model.errors import ConfigError
from pdserve.model.parallel import ParallelLayout, WorkerLayout
from pdserve.model.random_checkpoint import make_checkpoint


def all_ep(ranks: int, **kw) -> WorkerLayout:
    """`pdserve plan --gpus ranks`'s layout: the routed experts split over all ranks."""
    return WorkerLayout(ranks, expert_parallel=ranks, **kw)


V3_141 = ["plan", "--preset", "v3-shape", "--gpus", "8", "--gpu-memory-gib", "141"]


@pytest.fixture(scope="module", params=["bf16", "fp8"])
def tiny_checkpoint(request, tmp_path_factory):
    out = tmp_path_factory.mktemp(f"tiny-{request.param}")
    return make_checkpoint(out / "ckpt", "tiny", dtype=request.param, progress=False), request.param


def _safetensors_data_bytes(directory) -> int:
    """Tensor bytes of every shard: the file size less its 8-byte length prefix and JSON header."""
    total = 0
    for path in directory.glob("*.safetensors"):
        with open(path, "rb") as f:
            (header_len,) = struct.unpack("<Q", f.read(8))
        total += path.stat().st_size - 8 - header_len
    return total


def test_weights_equal_the_checkpoint_files(tiny_checkpoint):
    directory, dtype = tiny_checkpoint
    args, weight_dtype = model_for_plan(str(directory))
    plan = plan_memory(args, weight_dtype, WorkerLayout(1), PlanSettings())
    assert plan.checkpoint_bytes == _safetensors_data_bytes(directory)
    assert plan.weight_format == dtype
    # the same shape from the preset plans the same bytes
    preset_args, preset_dtype = model_for_plan(preset="tiny", preset_dtype=dtype)
    assert plan_memory(preset_args, preset_dtype, WorkerLayout(1), PlanSettings()) == plan


def test_v3_fits_dp8_ep8_on_141_gib_and_prints_its_kv_capacity(capsys):
    assert main(V3_141) == 0
    out = capsys.readouterr().out
    args, dtype = model_for_plan(preset="v3-shape")
    assert args.num_hidden_layers == 61 and args.num_nextn_predict_layers == 1
    assert args.quantization is not None
    plan = plan_memory(args, dtype, all_ep(8), PlanSettings(gpu_memory_gib=141))
    assert plan.fits
    assert "attention-DP8 + EP8" in out
    # 62 cached layers (61 + MTP) of 576 bf16 values per token: 1152 bytes each
    assert plan.page_bytes == 62 * 64 * 1152
    assert plan.kv_tokens >= args.max_position_embeddings
    assert plan.worker_tokens == 8 * plan.kv_tokens
    assert f"{plan.num_pages} pages x 64 = {plan.kv_tokens} tokens" in out
    assert f"{plan.worker_tokens} tokens of KV" in out
    # weights + reserve + KV + free add up to the GPU, and the KV uses all but less than a page of the budget
    used = plan.total_weight_bytes + plan.total_reserve_bytes + plan.kv_bytes
    assert used + plan.free_bytes == int(141 * GIB)
    assert 0 <= plan.usable_bytes - used < plan.page_bytes


def test_v3_on_4_gpus_is_refused_naming_the_shortfall(capsys):
    argv = V3_141.copy()
    argv[argv.index("8")] = "4"
    assert main(argv) == 2
    captured = capsys.readouterr()
    # the table still shows what each rank needs
    assert captured.out.splitlines()[-1] == "does not fit"
    err = captured.err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: ")
    args, dtype = model_for_plan(preset="v3-shape")
    plan = plan_memory(args, dtype, all_ep(4), PlanSettings(gpu_memory_gib=141))
    assert not plan.fits
    short = plan.total_weight_bytes + plan.total_reserve_bytes - plan.usable_bytes
    assert short > 0
    assert f"{short / GIB:.2f} GiB more than the {plan.usable_bytes / GIB:.2f} GiB usable" in err[0]
    assert "--gpus 8" in err[0]  # the advice is a layout that fits
    with pytest.raises(MemoryPlanError, match="GiB more than"):
        plan.check()


@pytest.mark.parametrize("preset", ["tiny", "v3-shape"])
def test_ep_divides_routed_expert_bytes(preset):
    args, dtype = model_for_plan(preset=preset)
    whole = weight_bytes_per_rank(args, dtype, WorkerLayout(1), args.num_nextn_predict_layers)
    for n in (2, 4, 8, 16):
        split = weight_bytes_per_rank(args, dtype, all_ep(n), args.num_nextn_predict_layers)
        assert split["routed experts"] * n == whole["routed experts"]
        # under attention DP with dense layers replicated, nothing else is split
        assert {g: b for g, b in split.items() if g != "routed experts"} == {
            g: b for g, b in whole.items() if g != "routed experts"
        }
    # EP over part of the ranks: the other groups hold replicas
    ep2 = weight_bytes_per_rank(args, dtype, WorkerLayout(8, expert_parallel=2), 1)
    assert ep2["routed experts"] * 2 == whole["routed experts"]


def test_spare_expert_slots_are_counted_as_the_model_allocates_them():
    from pdserve.model.deepseek import MoE, Transformer

    args, dtype = model_for_plan(preset="tiny", preset_dtype="bf16")
    layout = all_ep(2, redundant_experts=4)
    plan = weight_bytes_per_rank(args, dtype, layout, args.num_nextn_predict_layers)
    model = Transformer(args, dtype, layout=ParallelLayout(layout, rank=0))
    spare_bytes = 0
    for layer in model.layers:
        if isinstance(layer.ffn, MoE):
            home = layer.ffn.slots.home_per_rank
            spare_bytes += sum(p[home:].nbytes for p in layer.ffn.experts.parameters())
    assert spare_bytes > 0 and plan["spare expert slots"] == spare_bytes
    assert weight_bytes_per_rank(args, dtype, all_ep(2), 1)["spare expert slots"] == 0


@pytest.mark.parametrize("preset_dtype", ["bf16", "fp8"])
def test_tensor_parallel_splits_are_linear_in_the_ranks(preset_dtype):
    """Replicated part + split part / n, for the attention heads and for the dense MLP and shared experts."""
    args, dtype = model_for_plan(preset="v3-shape", layers=4, preset_dtype=preset_dtype)

    def groups(n: int, **kw) -> dict[str, int]:
        return weight_bytes_per_rank(args, dtype, all_ep(n, **kw), 1)

    # an fp8 wkv_b is also held dequantized for absorbed decode attention; a bf16 one is used as it is
    absorbed = ("absorbed wkv_b copy",) if preset_dtype == "fp8" else ()
    assert (groups(1)["absorbed wkv_b copy"] > 0) == bool(absorbed)
    for kw, names in (
        ({"attention": "tensor"}, ("attention", *absorbed)),
        ({"dense": "tensor"}, ("dense MLP", "shared experts")),
    ):
        one, two, eight = groups(1, **kw), groups(2, **kw), groups(8, **kw)
        for name in names:
            split = 2 * (one[name] - two[name])  # one = rep + split, two = rep + split / 2
            assert split > 0
            assert eight[name] == one[name] - split + split // 8, name
    # the dense MLP and shared experts are wholly split; attention keeps q_a/kv_a and the norms whole
    dense8 = groups(8, dense="tensor")
    assert dense8["dense MLP"] * 8 == groups(1)["dense MLP"]
    tp8 = groups(8, attention="tensor")
    assert tp8["absorbed wkv_b copy"] * 8 == groups(1)["absorbed wkv_b copy"]
    assert tp8["attention"] > groups(1)["attention"] // 8


def test_kv_capacity_per_worker_dp_and_tp():
    args, dtype = model_for_plan(preset="v3-shape")
    settings = PlanSettings(gpu_memory_gib=141, kv_cache_dtype="fp8")
    dp = plan_memory(args, dtype, all_ep(8), settings)
    tp = plan_memory(args, dtype, all_ep(8, attention="tensor"), settings)
    assert dp.page_bytes == tp.page_bytes == 62 * 64 * 656  # fp8 rows: 656 bytes
    assert dp.worker_pages == 8 * dp.num_pages
    assert tp.worker_pages == tp.num_pages  # the latent cache is replicated on the TP ranks
    # TP holds an eighth of the head-split attention weights, so a rank has more room for pages
    assert tp.total_weight_bytes < dp.total_weight_bytes and tp.num_pages > dp.num_pages


def test_kv_shortfall_names_fp8_kv_when_it_fits(capsys):
    args, dtype = model_for_plan(preset="v3-shape")
    base = PlanSettings(gpu_memory_gib=141)
    bf16_tokens = plan_memory(args, dtype, all_ep(8), base).kv_tokens
    fp8 = dataclasses.replace(base, kv_cache_dtype="fp8")
    fp8_tokens = plan_memory(args, dtype, all_ep(8), fp8).kv_tokens
    assert fp8_tokens > bf16_tokens
    max_len = (bf16_tokens + fp8_tokens) // 2
    assert main([*V3_141, "--max-model-len", str(max_len)]) == 2
    err = capsys.readouterr().err
    assert f"holds {bf16_tokens} tokens, below one {max_len}-token request" in err
    assert f"--kv-cache-dtype fp8 ({fp8_tokens} KV tokens per rank)" in err
    assert main([*V3_141, "--max-model-len", str(max_len), "--kv-cache-dtype", "fp8"]) == 0


def test_stacking_padding_of_a_q_lora_rank_off_the_quant_block():
    # tiny's q_lora_rank 96 is stacked with kv_a in one weight whose second part starts at row 128
    args, dtype = model_for_plan(preset="tiny", preset_dtype="bf16")
    plan = plan_memory(args, dtype, WorkerLayout(1), PlanSettings())
    cached_layers = args.num_hidden_layers + args.num_nextn_predict_layers
    assert (
        plan.weight_bytes["stacking padding"] == (128 - 96) * args.hidden_size * 2 * cached_layers
    )


def test_layouts_the_model_cannot_split_are_config_errors():
    args, dtype = model_for_plan(preset="v3-shape")
    with pytest.raises(ConfigError, match="expert_parallel=3: must divide ranks=8"):
        WorkerLayout(8, expert_parallel=3)
    with pytest.raises(ConfigError, match="attention='sp'"):
        WorkerLayout(8, attention="sp")
    with pytest.raises(ConfigError, match="EP 512: must divide n_routed_experts=256"):
        plan_memory(args, dtype, all_ep(512), PlanSettings())
    # 18432 / 32 = 576 rows per rank: not a multiple of the 128-row quant block
    with pytest.raises(ConfigError, match="quant block"):
        plan_memory(args, dtype, all_ep(32, dense="tensor"), PlanSettings())
    with pytest.raises(ConfigError, match="gpu_memory_utilization=1.5"):
        PlanSettings(gpu_memory_utilization=1.5)


def test_cli_exit_codes_and_errors(tmp_path, capsys):
    assert main(["plan", "--preset", "tiny", "--gpus", "2", "--gpu-memory-gib", "8"]) == 0
    assert capsys.readouterr().out.splitlines()[-1] == "fits"
    assert main(["plan", "--preset", "tiny", "--gpus", "8", "--ep", "3"]) == 2
    assert "expert_parallel=3: must divide ranks=8" in capsys.readouterr().err
    assert main(["plan", "--model", str(tmp_path), "--gpus", "1"]) == 2
    assert "no config.json" in capsys.readouterr().err
    (tmp_path / "config.json").write_text(json.dumps({"torch_dtype": "int8"}))
    assert main(["plan", "--model", str(tmp_path), "--gpus", "1"]) == 2
    assert "torch_dtype='int8'" in capsys.readouterr().err
    with pytest.raises(SystemExit) as e:  # argparse: one of --model / --preset is required
        main(["plan", "--gpus", "1"])
    assert e.value.code == 2


def test_help_explains_every_flag():
    parser, _ = _build_parser(config_flags=False)
    sub = next(a for a in parser._actions if a.dest == "command")
    plan = sub.choices["plan"]
    flags = [a for a in plan._actions if a.option_strings and a.dest != "help"]
    assert len(flags) >= 14
    for action in flags:
        assert action.help, action.option_strings
    assert "v3-shape" in plan.format_help()
    # the flags' defaults are the plan's own
    defaults = PlanSettings()
    parsed = plan.parse_args(["--preset", "tiny", "--gpus", "1"])
    for name in ("gpu_memory_gib", "gpu_memory_utilization", "page_size", "kv_cache_dtype"):
        assert getattr(parsed, name) == getattr(defaults, name), name
    for name in ("max_num_batched_tokens", "max_running", "max_model_len"):
        assert getattr(parsed, name) == getattr(defaults, name), name
    assert parsed.ep is None and parsed.attention == "dp" and parsed.dense == "replicated"
    assert layout_from_args(parsed) == WorkerLayout(1) == WorkerLayout(1, "data", 1, "replicated")
    # the flags' short spelling is the plan's parsing boundary; the layout has one
    parsed = plan.parse_args(
        ["--preset", "tiny", "--gpus", "4", "--attention", "tp", "--dense", "tp"]
    )
    assert layout_from_args(parsed) == WorkerLayout(4, "tensor", 4, "tensor")


def test_plan_needs_no_gpu_and_no_weights():
    # a plan for a model far larger than this machine is pure arithmetic over shapes
    args, dtype = model_for_plan(preset="v3-shape")
    assert dtype == torch.bfloat16
    plan = plan_memory(args, dtype, WorkerLayout(1), PlanSettings(gpu_memory_gib=2000))
    assert plan.checkpoint_bytes > 600e9


@pytest.mark.parametrize(
    "layout",
    [WorkerLayout(4, "data", 4), WorkerLayout(2, "tensor", 2, "tensor")],
    ids=["dp4-ep4", "tp2-ep2"],
)
def test_startup_keeps_the_plans_reserve_free(layout, monkeypatch):
    """A worker sizes its KV cache at startup leaving free what `pdserve plan` reserves for the same layout and
    step bounds, so the largest step finds its activations and exchange buffers (a decode worker of DP4 + EP4
    on 80 GiB GPUs, given 0.85 of the memory the weights left, ran out of memory in its first 8192-token
    step); a small reserve leaves the fraction in force."""
    from pdserve.engine.rank_memory import worker_reserve_bytes
    from pdserve.model.kv_cache import KVCacheLayout, capacity_pages

    args, dtype = model_for_plan(None, "v3-shape", 8, "fp8")
    model = type("Loaded", (), {"args": args, "dtype": dtype, "layout": ParallelLayout(layout)})
    reserve = worker_reserve_bytes(model, 8192, 512)
    plan = plan_memory(
        args, dtype, layout,
        PlanSettings(gpu_memory_gib=80, max_num_batched_tokens=8192, max_running=512),
    )  # fmt: skip
    assert reserve == plan.total_reserve_bytes > 4 * GIB
    # speculating, a rank also keeps its sampled requests' draft distributions (twice, fp32)
    spec = worker_reserve_bytes(model, 8192, 512, num_drafts=3)
    requests = min(512 // layout.attention_dp_size, 256)
    assert spec - reserve >= 2 * 3 * requests * args.vocab_size * 4
    kv = KVCacheLayout.for_model(args, 64, torch.bfloat16, 1)
    total, in_use = 80 * GIB, plan.total_weight_bytes + GIB // 2  # the weights and a CUDA context
    free = total - in_use
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (free, total))
    pages = capacity_pages(kv, "cuda", None, 0.85, 0, reserve, GPU_MEMORY_UTILIZATION)
    assert pages == (int(total * GPU_MEMORY_UTILIZATION) - in_use - reserve) // kv.page_bytes
    context_pages = GIB // 2 / kv.page_bytes
    assert (
        abs(pages - (plan.num_pages - context_pages)) <= 1
    )  # the plan's cache, less the context's
    # a small reserve and a low fraction leave the fraction in force, as before the reserve
    assert capacity_pages(kv, "cuda", None, 0.3, 0, GIB, 0.9) == int(free * 0.3) // kv.page_bytes
    with pytest.raises(ValueError, match="reserve of .* GiB for the largest step"):
        capacity_pages(kv, "cuda", None, 0.85, 0, free)


def test_the_host_kv_tier_is_counted_and_printed(capsys):
    args, dtype = model_for_plan(preset="v3-shape")
    settings = PlanSettings(gpu_memory_gib=141, kv_cache_dtype="fp8", host_kv_cache_gib=64)
    plan = plan_memory(args, dtype, all_ep(8), settings)
    assert plan.host_pages == 64 * GIB // (62 * 64 * 656)
    assert plan_memory(args, dtype, all_ep(8), PlanSettings(gpu_memory_gib=141)).host_pages == 0
    assert main([*V3_141, "--kv-cache-dtype", "fp8", "--host-kv-cache-gib", "64"]) == 0
    out = capsys.readouterr().out
    assert f"{plan.host_pages} pages x 64 = {plan.host_pages * 64} tokens per KV page set" in out
    main(V3_141)
    assert "host KV tier" not in capsys.readouterr().out
    with pytest.raises(ConfigError, match="host_kv_cache_gib=-1"):
        PlanSettings(host_kv_cache_gib=-1)
