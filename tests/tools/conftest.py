"""Shared checks for the tool-executor tests: every test must leave the test process as
it found it (same pid and working directory, its environment intact, no child process
left running) and leave no sandbox working directory behind. The sandboxes of these
tests make their working directories in a private temporary directory so that the check
does not see another test process's sandboxes."""

import os
import shutil
import sys
import tempfile

import pytest

SECRET_NAME = "ARL_TOOLS_TEST_SECRET"
SECRET_VALUE = "s3cr3t-7f1c2e9a"


def child_pids() -> list[int]:
    """Processes whose parent is this process."""
    me, children = os.getpid(), []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == me and fields[0] != "Z":
            children.append(int(entry))
    return children


def other_python() -> str | None:
    """The machine's own python3 when it is another interpreter than the tests' (escapes
    were first shown with Debian's as well), else None."""
    found = shutil.which("python3", path="/usr/bin:/bin")
    if found and os.path.realpath(found) != os.path.realpath(sys.executable):
        return os.path.realpath(found)
    return None


@pytest.fixture(scope="session", autouse=True)
def private_tempdir():
    """tempfile's directory for this test process (world-traversable, as the sandbox
    may run as another uid), removed at the end."""
    directory = tempfile.mkdtemp(prefix="arl-tools-tests-")
    os.chmod(directory, 0o755)
    previous = tempfile.tempdir
    tempfile.tempdir = directory
    os.environ[SECRET_NAME] = SECRET_VALUE
    yield directory
    tempfile.tempdir = previous
    os.environ.pop(SECRET_NAME, None)
    shutil.rmtree(directory, ignore_errors=True)


@pytest.fixture(autouse=True)
def parent_unaffected(private_tempdir):
    pid, cwd = os.getpid(), os.getcwd()
    yield
    assert os.getpid() == pid
    assert os.getcwd() == cwd
    assert os.environ.get(SECRET_NAME) == SECRET_VALUE
    assert child_pids() == [], "a sandbox process outlived its call"
    leftovers = [name for name in os.listdir(private_tempdir) if name.startswith("arl-sandbox")]
    assert leftovers == [], f"sandbox working directories left behind: {leftovers}"
