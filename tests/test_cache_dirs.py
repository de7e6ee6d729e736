"""A cache folder that cannot be created or written turns the compile cache and the profile store off with one note
each; decoding goes on (issue 18). We run as root in CI, where chmod does not stop writes: the unusable folders are
a path under a regular file (ENOTDIR) and a read-only bind mount (skipped where mounting is not allowed)."""

import os
import subprocess
import sys

import pytest

from ft_jax import api
from ft_jax.cache_dirs import folder_problem, output_file_problem, replace_file

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def generate(cache_home, *extra):
    env = dict(os.environ, PYTHONPATH=REPO, XDG_CACHE_HOME=str(cache_home))
    return subprocess.run([sys.executable, "-m", "ft_jax", "generate", "--temperature", "0", "--max-new-tokens", "8",
                           "--policy", "qstar", *extra], capture_output=True, text=True, env=env, timeout=300)


def notes(stderr):
    return [line for line in stderr.splitlines() if line.startswith("ft-jax: ") and "building the " not in line]


def test_folder_problem(tmp_path):
    assert folder_problem(tmp_path / "new" / "deeper") is None and (tmp_path / "new" / "deeper").is_dir()
    assert os.listdir(tmp_path / "new" / "deeper") == []  # the probe is gone
    (tmp_path / "file").write_text("x")
    assert folder_problem(tmp_path / "file" / "ft_jax") == "a component of the path is not a folder"


def test_enable_compile_cache_returns_a_note(tmp_path):
    (tmp_path / "file").write_text("x")
    note = api.enable_compile_cache(str(tmp_path / "file" / "compile"))
    assert note.startswith("the compilation cache is off: ") and "not a folder" in note


def test_cache_home_under_a_file_decodes(tmp_path):
    (tmp_path / "file").write_text("x")
    r = generate(tmp_path / "file")
    assert r.returncode == 0, r.stderr
    assert len(r.stdout.strip()) > 0
    assert "Traceback" not in r.stderr and "Warning" not in r.stderr and "WARNING" not in r.stderr, r.stderr
    found = notes(r.stderr)
    assert len(found) == 2, r.stderr
    assert found[0].startswith("ft-jax: the compilation cache is off: ") and "not a folder" in found[0]
    assert "the profile store is off" in found[1] and "not a folder" in found[1]


def _bind_read_only(folder) -> bool:
    if os.geteuid() != 0:
        subprocess.run(["chmod", "-R", "a-w", str(folder)], check=True)
        return True
    ok = subprocess.run(["mount", "--bind", str(folder), str(folder)], capture_output=True).returncode == 0
    if ok and subprocess.run(["mount", "-o", "remount,bind,ro", str(folder)], capture_output=True).returncode != 0:
        subprocess.run(["umount", str(folder)], capture_output=True)
        ok = False
    return ok


def test_read_only_cache_with_entries_decodes_with_one_note(tmp_path):
    home = tmp_path / "home"
    first = generate(home)
    assert first.returncode == 0, first.stderr
    assert os.listdir(home / "ft_jax" / "compile")  # entries written
    if not _bind_read_only(home):
        pytest.skip("cannot make a read-only folder here (not root with mount, and chmod does not stop root)")
    try:
        r = generate(home)
    finally:
        if os.geteuid() == 0:
            subprocess.run(["umount", str(home)], capture_output=True)
        else:
            subprocess.run(["chmod", "-R", "u+w", str(home)])
    assert r.returncode == 0, r.stderr
    assert "Traceback" not in r.stderr and "Warning" not in r.stderr and "WARNING" not in r.stderr, r.stderr
    found = notes(r.stderr)
    assert found[0].startswith("ft-jax: the compilation cache is off: ") and "read-only" in found[0].lower(), r.stderr
    assert "using the bandwidth profile stored in" in found[1]  # the store is still read
    assert len(found) == 2, r.stderr
    assert len(r.stderr.splitlines()) < 20, r.stderr  # was 54 lines with JAX's cache-write warnings


def test_an_output_file_is_probed_not_trusted_to_permission_bits(tmp_path):
    """output_file_problem (--record-trace, --profile, profile=): a name is needed, a folder is not one, and the folder
    is probed by a write, so /proc (which exists, refuses new files, and whose bits root would pass) is refused;
    nothing stays behind and an existing file keeps its bytes."""
    assert output_file_problem("") == "expected a file name"
    assert output_file_problem(str(tmp_path) + os.sep) == "expected a file name"
    assert output_file_problem(str(tmp_path)) == "is a directory, expected a file name"
    assert output_file_problem("/proc/x.json") == "folder /proc does not exist or is not writable"
    assert output_file_problem(str(tmp_path / "no" / "x.json")) == (f"folder {tmp_path / 'no'} does not exist or is "
                                                                     "not writable")
    assert output_file_problem(str(tmp_path / "x.json")) is None
    (tmp_path / "old.json").write_text("keep")
    assert output_file_problem(str(tmp_path / "old.json")) is None
    assert sorted(p.name for p in tmp_path.iterdir()) == ["old.json"] and (tmp_path / "old.json").read_text() == "keep"


def test_replace_file_writes_whole_or_leaves_the_old_file(tmp_path):
    path = tmp_path / "record.json"
    path.write_text("old")
    replace_file(path, lambda f: f.write("new"))
    assert path.read_text() == "new"

    def half_then_fail(f):
        f.write("half")
        raise OSError(28, "No space left on device")

    with pytest.raises(OSError, match="No space left"):
        replace_file(path, half_then_fail)
    assert path.read_text() == "new" and sorted(p.name for p in tmp_path.iterdir()) == ["record.json"]
    replace_file(tmp_path / "b.bin", lambda f: f.write(b"\x00\x01"), binary=True)
    assert (tmp_path / "b.bin").read_bytes() == b"\x00\x01"
