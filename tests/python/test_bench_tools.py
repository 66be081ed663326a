"""The benchmark tools that are not benchmarks themselves. bench/kernel_ab.sh, the build of the
in-process comparison of two builds of the Hopper kernels (A from a git revision, B from the working
tree): it compiles and links (running it needs an H100 or H200), names what it compared, and refuses
an unknown option with its usage. bench/backward_order_model.py, the fused backward's schedule
model: its orders against one another, and a grid that cannot deadlock never does. The trace
arithmetic of bench_model.py --gaps, bench/profiling.py's profiler over a closure's calls, and
bench/gate_grad_precision.py's emulation of the gate gradient's arithmetic."""
import importlib.util
import os
import shutil
import subprocess

import pytest

from test_cmake_consumer import REPO_ROOT

SCRIPT = REPO_ROOT / "bench" / "kernel_ab.sh"


def nvcc_dir():
    home = os.environ.get("CUDA_HOME")
    candidates = [os.path.join(home, "bin")] if home else []
    found = shutil.which("nvcc")
    if found:
        candidates.append(os.path.dirname(found))
    for d in candidates:
        if os.path.isfile(os.path.join(d, "nvcc")):
            return d
    pytest.skip("needs nvcc (CUDA_HOME or PATH)")


def cutlass_include():
    cutlass_library = pytest.importorskip("cutlass_library")
    path = os.path.join(os.path.dirname(cutlass_library.__file__), "source", "include")
    if not os.path.isfile(os.path.join(path, "cute", "arch", "mma_sm90_gmma.hpp")):
        pytest.skip("the nvidia-cutlass wheel has no CUTLASS headers")
    return path


@pytest.mark.slow
def test_kernel_ab_builds_against_head(tmp_path):
    if not (REPO_ROOT / ".git").exists():
        pytest.skip("needs the git checkout (build A comes from a revision)")
    env = dict(os.environ, PATH=f"{nvcc_dir()}{os.pathsep}{os.environ['PATH']}",
               FOX_CUTLASS_INCLUDE_DIR=cutlass_include())
    out = tmp_path / "ab"
    result = subprocess.run(["bash", str(SCRIPT), "--base", "HEAD", "--out", str(out), "--",
                             "-DFOX_SECTION_MIB_QUERY_BLOCKS=24"],
                            env=env, capture_output=True, text=True, timeout=3600)
    assert result.returncode == 0, result.stdout + result.stderr
    assert out.is_file() and os.access(out, os.X_OK)
    assert "B = the working tree (-DFOX_SECTION_MIB_QUERY_BLOCKS=24)" in result.stdout, result.stdout


@pytest.mark.slow
def test_kernel_ab_refuses_an_unknown_option():
    result = subprocess.run(["bash", str(SCRIPT), "--bogus"], capture_output=True, text=True, timeout=60)
    assert result.returncode == 2
    assert "--base REV" in result.stderr


def test_gate_grad_precision():
    """The emulated kernels' dlog f (T=512, D=128): within the tests' rule with the row sums of dS;
    without them (delta from the bf16 output) several times worse; with delta from the output and
    its bf16 rounding residual far better, and better still from the float32 output."""
    spec = importlib.util.spec_from_file_location("gate_grad_precision",
                                                  REPO_ROOT / "bench" / "gate_grad_precision.py")
    study = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(study)
    e = study.errors(512, 128, "normal")
    assert e["rows"] < e["bound"] / 4, e
    assert e["no-rows"] > 3 * e["rows"], e
    assert e["resid16"] < e["rows"] / 10, e
    assert e["exact"] < e["resid16"] / 4, e


def load_order_model():
    path = REPO_ROOT / "bench" / "backward_order_model.py"
    spec = importlib.util.spec_from_file_location("backward_order_model", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_backward_order_model():
    """A small grid (8 rows of 16 key tiles, 2 rows a section, 16 slots): the last-first order's
    end costs against any order, and the last section walking down takes most of that back; the
    deadlock-free orders end on any number of slots, even one, and first-first in turns does not
    when a section's blocks cannot all run at once."""
    model = load_order_model()
    rows, key_tiles, per_section, ratio = 8, 16, 2, 2
    ideal = rows * sum(2 * key_tiles - ratio * kt for kt in range(key_tiles)) / 16

    def span(order, sms=16):
        blocks = model.grid(rows, key_tiles, per_section, order)
        assert sorted((r, kt) for r, kt, _ in blocks) == [(r, kt) for r in range(rows) for kt in range(key_tiles)]
        return model.makespan(blocks, 2 * key_tiles, ratio, lam=0.65, sms=sms,
                              turns=order != "any-order") / ideal

    last_first, any_order, last_down = span("last-first"), span("any-order"), span("last-down")
    assert last_first > any_order + 0.03
    assert last_down < last_first - 0.02
    for order in ("last-first", "last-down"):  # one slot: every block alone, in grid order
        assert span(order, sms=1) == pytest.approx(16 * (1.0 + 0.05 / 2), rel=0.05)
    with pytest.raises(RuntimeError, match="deadlock"):
        span("first-first", sms=4)


def test_idle_summary(monkeypatch):
    """bench_model.py --gaps' arithmetic on a made-up trace of two steps of four kernels: the
    stretch between the steps is left out, the rest is summed a step, by tenth of the step and by
    the kernel that waited."""
    monkeypatch.syspath_prepend(str(REPO_ROOT / "bench"))  # its sibling modules
    spec = importlib.util.spec_from_file_location("bench_model", REPO_ROOT / "bench" / "bench_model.py")
    bench_model = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench_model)
    starts = [0, 15, 25, 36, 1040, 1053, 1063, 1073]  # idle 5, 0, 1 | 1000 | 3, 0, 0
    durations = [10, 10, 10, 4] * 2
    trace = [{"name": f"k{i % 4}", "ts": t, "dur": d} for i, (t, d) in enumerate(zip(starts, durations))]
    s = bench_model.idle_summary(trace, steps=2, min_us=2.0)
    assert s["kernels"] == 4
    assert s["busy_ms"] == pytest.approx(0.034)
    assert s["idle_ms"] == pytest.approx(0.0045)
    assert s["idle_long_ms"] == pytest.approx(0.004)
    assert s["by_kernel_us"] == pytest.approx({"k1": 4.0})
    assert s["tenths_us"] == pytest.approx([0, 0, 4.0, 0, 0, 0, 0, 0.5, 0, 0])
    assert s["largest"][0] == (5, "k0", "k1")


def test_profiled_counts_the_profiled_calls_only(monkeypatch):
    """bench/profiling.py's profiled: the warm-up calls run outside the profile, the profiled
    calls inside it (here on the CPU: one aten::add a call)."""
    from torch.profiler import ProfilerActivity
    import torch
    monkeypatch.syspath_prepend(str(REPO_ROOT / "bench"))
    from profiling import profiled
    calls = []
    x = torch.ones(4)

    def fn():
        calls.append(1)
        return x + 1

    prof = profiled(fn, 3, [ProfilerActivity.CPU], warmup=2)
    assert len(calls) == 5
    adds = [e for e in prof.key_averages() if e.key == "aten::add"]
    assert len(adds) == 1 and adds[0].count == 3
