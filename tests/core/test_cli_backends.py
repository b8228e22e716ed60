"""``polyspec backends`` and the CLI's error handling (polyspec.cli, polyspec.commands)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from plugin_packages import ensure_test_plugins_installed

import polyspec.commands
from polyspec import cli
from polyspec.backends.cpu.plugin import CAPABILITIES

REQUIRED_KEYS = {"name", "available", "reason", "distribution", "version", "capabilities"}


@pytest.fixture(scope="module", autouse=True)
def _test_plugins_installed() -> None:
    ensure_test_plugins_installed()


@pytest.fixture(autouse=True)
def _clean_env(monkeypatch):
    for var in (
        "POLYSPEC_BACKEND",
        "POLYSPEC_PLUGINS",
        "POLYSPEC_STRICT_PLUGINS",
        "POLYSPEC_DISABLE_PLUGIN_AUTOLOAD",
    ):
        monkeypatch.delenv(var, raising=False)


def test_backends_table(capsys):
    assert cli.main(["backends"]) == 0
    out = capsys.readouterr().out
    rows = {line.split()[0]: line.split() for line in out.splitlines() if line.strip()}
    assert rows["cpu"][1] == "available"
    assert rows["cuda"][1] == "unavailable" and rows["npu"][1] == "unavailable"
    assert rows["example"][1] == "available" and rows["broken"][1] == "error"
    assert "polyspec-example-backend" in rows["example"]
    assert any(line.startswith("cuda: unavailable: ") for line in out.splitlines())
    assert any(line.startswith("npu: unavailable: ") for line in out.splitlines())
    assert "default selection: cpu" in out
    # capabilities as flags: cuda's reads overlap (overlap_rounds auto), the cpu's do not
    assert "async_host_reads" in rows["cuda"] and "async_execution" in rows["cuda"]
    assert "async_host_reads" not in rows["cpu"] and "async_host_reads" not in rows["npu"]


def test_backends_json(capsys):
    assert cli.main(["backends", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert isinstance(data, list)
    by_name = {d["name"]: d for d in data}
    for entry in data:
        assert REQUIRED_KEYS <= set(entry)
        assert isinstance(entry["available"], bool) and isinstance(entry["reason"], str)
        assert isinstance(entry["capabilities"], dict)
    cpu = by_name["cpu"]
    assert cpu["available"] is True and cpu["reason"] == ""
    assert cpu["distribution"] == "polyspec"
    assert cpu["capabilities"] == CAPABILITIES.to_dict()
    assert by_name["cuda"]["available"] is False and by_name["cuda"]["reason"]
    assert by_name["npu"]["available"] is False and by_name["npu"]["reason"]
    assert by_name["broken"]["error"] and by_name["broken"]["available"] is False


def test_polyspec_error_prints_one_line_and_exits_2(capsys, monkeypatch):
    monkeypatch.setenv("POLYSPEC_STRICT_PLUGINS", "1")
    assert cli.main(["backends"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("polyspec: error: backend plugin 'broken'")
    assert "Traceback" not in err


def test_console_entry_point_runs(tmp_path):
    proc = subprocess.run(
        [sys.executable, "-m", "polyspec", "backends", "--json"],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=tmp_path,
    )
    assert proc.returncode == 0, proc.stderr
    assert {d["name"] for d in json.loads(proc.stdout)} >= {"cpu", "cuda", "npu", "example"}


def test_usage_errors_and_version(capsys):
    assert cli.main([]) == 2
    assert cli.main(["backends", "--nope"]) == 2
    assert cli.main(["--version"]) == 0
    assert "polyspec" in capsys.readouterr().out


def test_missing_command_modules_are_skipped(monkeypatch):
    monkeypatch.setattr(cli, "COMMAND_MODULES", ("not_written_yet", "backends"))
    parser = cli.build_parser()
    assert parser.parse_args(["backends"]).command == "backends"


def test_import_errors_inside_a_command_module_propagate(monkeypatch, tmp_path):
    (tmp_path / "badcmd.py").write_text("import no_such_dependency_for_polyspec_tests\n")
    monkeypatch.setattr(polyspec.commands, "__path__", [*polyspec.commands.__path__, str(tmp_path)])
    monkeypatch.setattr(cli, "COMMAND_MODULES", ("badcmd", "backends"))
    monkeypatch.delitem(sys.modules, "polyspec.commands.badcmd", raising=False)
    with pytest.raises(ModuleNotFoundError, match="no_such_dependency_for_polyspec_tests"):
        cli.build_parser()


def test_a_reader_that_leaves_early_gets_no_traceback():
    """``polyspec backends | head -1``: the closed pipe ends the command quietly (status 141,
    as a shell reports SIGPIPE), without a BrokenPipeError traceback on stderr."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "polyspec", "backends"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    proc.stdout.close()  # before the command prints anything: its imports take longer
    err = proc.stderr.read().decode()
    assert proc.wait(timeout=120) == 141, err
    assert "Traceback" not in err and "BrokenPipeError" not in err, err
