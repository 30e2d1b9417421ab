"""`pdserve make-checkpoint --distill-mtp`: a tiny checkpoint written and distilled in one command, an existing
one distilled in place with --distill-only, and bad flag values refused by name before anything is written."""

from __future__ import annotations

import pytest

from pdserve.cli.main import main as cli_main

SMALL = ["--distill-seq-len", "12", "--distill-sequences", "4", "--distill-device", "cpu"]


def test_write_then_distill_then_distill_only(tmp_path, capsys):
    out = tmp_path / "ck"
    assert (
        cli_main(
            [
                "make-checkpoint",
                str(out),
                "--preset",
                "tiny",
                "--dtype",
                "fp32",
                "--distill-mtp",
                "2",
                *SMALL,
            ]
        )
        == 0
    )
    printed = capsys.readouterr().out
    assert "wrote tiny (fp32)" in printed and "step 2/2" in printed
    assert f"distilled MTP of {out}" in printed and "held-out agreement" in printed
    shards = sorted(out.glob("*.safetensors"))
    mtimes = [p.stat().st_mtime_ns for p in shards]
    code = cli_main(["make-checkpoint", str(out), "--distill-only", "--distill-mtp", "1", *SMALL])
    assert code == 0
    assert "step 1/1" in capsys.readouterr().out
    assert sorted(out.glob("*.safetensors")) == shards  # rewritten in place, no file added
    assert any(p.stat().st_mtime_ns != m for p, m in zip(shards, mtimes, strict=True))


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--distill-mtp", "0"], "--distill-mtp: steps=0"),
        (["--distill-mtp", "3", "--distill-lr", "-1"], "--distill-lr: lr=-1.0"),
        (["--distill-mtp", "3", "--distill-seq-len", "4"], "--distill-seq-len: seq_len=4"),
        (["--distill-mtp", "3", "--distill-sequences", "0"], "--distill-sequences"),
        (["--distill-mtp", "3", "--distill-device", "nope"], "--distill-device"),
        (["--distill-mtp", "3", "--config-only"], "--config-only writes no weights"),
        (["--distill-only"], "give the steps with --distill-mtp"),
        (["--distill-only", "--distill-mtp", "3"], "is not a checkpoint"),
    ],
)
def test_bad_flags_are_refused_before_writing(tmp_path, capsys, flags, message):
    out = tmp_path / "ck"
    assert cli_main(["make-checkpoint", str(out), *flags]) == 2
    assert message in capsys.readouterr().err
    assert not out.exists()
