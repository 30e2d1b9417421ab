"""Random checkpoints shared by the model tests (made once per session)."""

from __future__ import annotations

import pytest

from pdserve.model.random_checkpoint import make_checkpoint

# name -> (preset, dtype, overrides)
VARIANTS = {
    "tiny-fp32": ("tiny", "fp32", {}),
    "tiny-bf16": ("tiny", "bf16", {}),
    "tiny-fp8": ("tiny", "fp8", {}),
    # q_lora_rank null (one q projection), no dense layer, one expert group, no YaRN.
    "plain-fp32": (
        "tiny",
        "fp32",
        {
            "q_lora_rank": None,
            "first_k_dense_replace": 0,
            "n_group": 1,
            "topk_group": 1,
            "rope_scaling": None,
            "num_nextn_predict_layers": 0,
        },
    ),  # fmt: skip
    # The newer `rope_parameters` spelling; YaRN with mscale != mscale_all_dim (cos/sin scaled too), 3 layers.
    "yarn-fp32": (
        "tiny",
        "fp32",
        {
            "num_hidden_layers": 3,
            "rope_scaling": None,
            "rope_theta": None,
            "rope_parameters": {
                "rope_type": "yarn",
                "rope_theta": 50000.0,
                "factor": 8.0,
                "original_max_position_embeddings": 512,
                "beta_fast": 16,
                "beta_slow": 2,
                "mscale": 0.8,
                "mscale_all_dim": 1.0,
            },
        },
    ),  # fmt: skip
}


@pytest.fixture(scope="session")
def checkpoint(tmp_path_factory):
    made = {}

    def get(name: str):
        if name not in made:
            preset, dtype, overrides = VARIANTS[name]
            out = tmp_path_factory.mktemp("ckpt") / name
            made[name] = make_checkpoint(
                out, preset, dtype=dtype, overrides=overrides, shard_bytes=2 << 20, progress=False
            )
        return made[name]

    return get
