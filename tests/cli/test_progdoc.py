"""``--version``, ``--print-completion bash`` and ``--print-man`` of every command, generated from its
argparse parser (capctl.progdoc): the completion script is valid bash that completes the real
subcommands, the man page names the command, its version and its flags."""

from __future__ import annotations

import shutil
import subprocess
import sys

import pytest

from capctl import __version__

COMMANDS = {
    "capctl": "capctl.cli.main",
    "capctl-agent": "nodeagent.daemon",
    "capctl-coordinator": "coordinator.daemon",
    "capctl-simgpu": "capctl.simgpu.entry",
}


def run(module: str, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", module, *args], capture_output=True, text=True, timeout=60)


@pytest.mark.parametrize("prog", sorted(COMMANDS))
def test_version_completion_and_man_page(prog, tmp_path):
    module = COMMANDS[prog]
    version = run(module, "--version")
    assert version.returncode == 0 and version.stdout == f"{prog} {__version__}\n"
    completion = run(module, "--print-completion", "bash")
    assert completion.returncode == 0 and "--version" in completion.stdout
    script = tmp_path / prog
    script.write_text(completion.stdout)
    if shutil.which("bash"):
        check = subprocess.run(["bash", "-c", f"source {script} && complete -p {prog}"], capture_output=True,
                               text=True, timeout=30)
        assert check.returncode == 0 and prog in check.stdout, check.stderr
    man = run(module, "--print-man")
    assert man.returncode == 0
    title = prog.upper().replace("-", "\\-")
    assert man.stdout.startswith(f'.TH {title} "1"') and f"capctl {__version__}" in man.stdout
    assert "\\-\\-version" in man.stdout


def test_the_capctl_completion_offers_its_subcommands():
    out = run("capctl.cli.main", "--print-completion", "bash").stdout
    for sub in ("status", "nodes", "jobs", "explain", "budget", "policy", "install", "demo", "sim"):
        assert sub in out, sub


@pytest.mark.parametrize("empty", ["", "  "])
def test_install_refuses_an_empty_dir(tmp_path, empty):
    """``capctl install hooks ""`` (an unset variable quoted) wrote the hooks into the current
    directory and exited 0 (found by a review): an empty DIR is refused, nothing written."""
    proc = subprocess.run([sys.executable, "-m", "capctl.cli.main", "install", "hooks", empty], cwd=tmp_path,
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 1 and "DIR is empty" in proc.stderr, proc.stderr
    assert "Traceback" not in proc.stderr and list(tmp_path.iterdir()) == []
