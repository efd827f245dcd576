import json

from smemguard import cli


def test_demo_shows_the_overflow_and_the_recovery(capsys):
    assert cli.main(["demo"]) == 0
    out = capsys.readouterr().out
    assert "OutOfResources: shared memory, Required: 131072, Hardware limit: 101376" in out
    assert "-> ran with 4 stages, 98304 B, grid (4, 4, 1)" in out
    assert "action       stages_reduced" in out
    assert "num_stages=5: 131072 B; num_stages=4: 98304 B" in out


def test_demo_rejects_a_gpu_it_cannot_stand_in_for(capsys):
    assert cli.main(["demo", "--gpu", "MI300X"]) == 2
    assert "not an NVIDIA GPU" in capsys.readouterr().err


def test_gpus_table_and_json(capsys):
    assert cli.main(["gpus"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].split() == ["GPU", "aliases", "arch", "bytes/block"]
    assert any(line.split()[:1] == ["L4"] and line.split()[-2:] == ["sm_89", "101376"] for line in lines)
    assert cli.main(["gpus", "--json"]) == 0
    table = json.loads(capsys.readouterr().out)
    assert {"name": "T4", "aliases": [], "arch": "sm_75", "max_shared": 65536} in table


def test_help_teaches_the_commands_and_settings(capsys):
    assert cli.main([]) == 2
    out = capsys.readouterr().out
    for text in ("demo", "gpus", "VLLM_PLUGINS=smemguard", "SMEMGUARD_MAX_SHARED", "examples:"):
        assert text in out
