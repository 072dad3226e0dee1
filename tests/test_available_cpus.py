"""Thread counts that fit the machine the process really has (issue 25): the affinity mask
and cgroup CPU quotas size Numba's pool unless NUMBA_NUM_THREADS is set."""

import os
import subprocess
import sys

import pytest

from numbaconv import config


def _tree(tmp_path, proc: str, files: dict):
    (tmp_path / "proc").write_text(proc)
    for name, text in files.items():
        path = tmp_path / "cg" / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return str(tmp_path / "proc"), str(tmp_path / "cg")


def test_cgroup_v2_quota_is_the_smallest_along_the_path(tmp_path):
    proc, root = _tree(tmp_path, "0::/kubepods/pod1\n", {
        "kubepods/pod1/cpu.max": "150000 100000\n", "kubepods/cpu.max": "max 100000\n",
        "cpu.max": "400000 100000\n"})
    assert config._cgroup_cpu_limit(proc, root) == 1.5


def test_cgroup_v1_quota(tmp_path):
    proc, root = _tree(tmp_path, "4:memory:/docker/abc\n3:cpu,cpuacct:/docker/abc\n", {
        "cpu,cpuacct/docker/abc/cpu.cfs_quota_us": "200000\n",
        "cpu,cpuacct/docker/abc/cpu.cfs_period_us": "100000\n"})
    assert config._cgroup_cpu_limit(proc, root) == 2.0


@pytest.mark.parametrize("files", [{"cpu.max": "max 100000\n"},
                                   {"cpu,cpuacct/cpu.cfs_quota_us": "-1\n",
                                    "cpu,cpuacct/cpu.cfs_period_us": "100000\n"},
                                   {}])
def test_no_quota(tmp_path, files):
    proc, root = _tree(tmp_path, "1:cpu,cpuacct:/\n0::/\n", files)
    assert config._cgroup_cpu_limit(proc, root) is None


def test_missing_cgroup_files_mean_no_quota(tmp_path):
    assert config._cgroup_cpu_limit(str(tmp_path / "absent"), str(tmp_path)) is None


CHILD = """
import os, sys
{before}
import numba, numpy as np, numbaconv as nc
from numbaconv import config
nc.conv(np.ones((1, 1, 6, 6), np.float32), np.ones((1, 1, 3, 3), np.float32))
print(numba.get_num_threads(), '|', config.thread_decision)
"""


#: In a child: fake a cgroup quota of this many CPUs (a test cannot make a cgroup).
FAKE_QUOTA = "import numbaconv.config as c; c._cgroup_cpu_limit = lambda: {}"


def _child(code: str, unset=("NUMBA_NUM_THREADS",), **variables) -> str:
    """The output of ``code`` run in a fresh interpreter without the variables ``unset``
    and with ``variables``."""
    env = {k: v for k, v in os.environ.items() if k not in unset}
    env.update(variables)
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True,
                         text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    return out.stdout.strip()


@pytest.mark.skipif(not hasattr(os, "sched_setaffinity"), reason="no CPU affinity here")
def test_numba_threads_follow_the_affinity_mask():
    threads, why = _child(CHILD.format(
        before="os.sched_setaffinity(0, {sorted(os.sched_getaffinity(0))[0]})")).split(" | ")
    assert threads == "1" and "affinity" in why


def test_numba_threads_follow_a_cgroup_quota():
    """A quota below the affinity mask lowers Numba's pool before it starts."""
    threads, why = _child(CHILD.format(before=FAKE_QUOTA.format(0.5))).split(" | ")
    assert threads == "1" and "cgroup CPU quota of 0.5" in why


def test_numba_num_threads_set_by_the_user_wins():
    threads, why = _child(CHILD.format(before=FAKE_QUOTA.format(1.0)),
                          NUMBA_NUM_THREADS="3").split(" | ")
    assert threads == "3" and "NUMBA_NUM_THREADS is set" in why


def test_openblas_threads_follow_a_cgroup_quota():
    out = _child(FAKE_QUOTA.format(0.5) + "\nfrom numbaconv.cpu import _tiles\n"
                 "print(_tiles._blas().get_num_threads() if _tiles._blas() else 'none')",
                 unset=("NUMBA_NUM_THREADS", "OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS"))
    assert out in ("1", "none")
