"""``capctl install env``: an edited configuration file is kept and the shipped one written beside
it as NAME.new; --force replaces it; other kinds replace their files."""

from __future__ import annotations

import argparse

from capctl.cli import install


def _run(what: str, dest, **flags) -> None:
    install.run(argparse.Namespace(what=what, dir=str(dest), no_clobber=flags.get("no_clobber", False),
                                   force=flags.get("force", False)))


def test_an_edited_env_file_is_kept_and_the_shipped_one_written_beside_it(tmp_path, capsys):
    _run("env", tmp_path)
    shipped = {p.name: p.read_bytes() for p in tmp_path.iterdir()}
    assert set(shipped) == {"agent.env", "coordinator.env"}
    edited = tmp_path / "agent.env"
    edited.write_bytes(shipped["agent.env"] + b"CAPCTL_EXTRA=1\n")
    capsys.readouterr()
    _run("env", tmp_path)
    out = capsys.readouterr().out
    assert edited.read_bytes().endswith(b"CAPCTL_EXTRA=1\n")  # the admin's edit survives
    assert (tmp_path / "agent.env.new").read_bytes() == shipped["agent.env"]
    assert f"kept {edited} (edited)" in out and f"wrote {tmp_path / 'coordinator.env'}" in out  # unedited: rewritten
    assert not (tmp_path / "coordinator.env.new").exists()
    _run("env", tmp_path, force=True)
    assert edited.read_bytes() == shipped["agent.env"]
    assert not (tmp_path / "agent.env.new").exists()  # replaced: its waiting copy is gone


def test_other_kinds_replace_their_files(tmp_path):
    _run("hooks", tmp_path)
    prolog = tmp_path / "prolog"
    original = prolog.read_bytes()
    prolog.write_bytes(b"#!/bin/sh\nexit 0\n")
    _run("hooks", tmp_path)
    assert prolog.read_bytes() == original and not (tmp_path / "prolog.new").exists()
