"""Context parallelism (forgetting_transformer.distributed): 2, 3 and 4 CPU processes (gloo), each
with one chunk of the sequence, against the single-process op on the whole sequence, forward and
backward: float64 to rounding, bf16 within the 2x rule of the single-process op's own error. On
2 GPUs (nccl) the same where a machine has them."""
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from forgetting_transformer import forgetting_attention
from reference import rule_violations

sys.path.insert(0, str(Path(__file__).parent))
from context_parallel_worker import full_inputs  # noqa: E402

pytestmark = pytest.mark.slow
WORKER = Path(__file__).parent / "context_parallel_worker.py"


def run_ranks(tmp_path, lengths, dtypes=("float64",), env_extra=None, **opts):
    """Runs the worker on len(lengths) processes; returns {dtype: (out, [dq, dk, dv, dlog_fgate])}
    with the ranks' chunks concatenated."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path), OMP_NUM_THREADS="1",
               **(env_extra or {}))
    env.pop("WORLD_SIZE", None)
    args = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(len(lengths)),
            "--master_addr", "127.0.0.1", "--master_port", str(port), str(WORKER),
            "--lengths", *map(str, lengths), "--dtype", *dtypes, "--out-dir", str(tmp_path)]
    for key, value in opts.items():
        args += [f"--{key.replace('_', '-')}", str(value)]
    r = subprocess.run(args, capture_output=True, text=True, env=env, timeout=300)
    assert r.returncode == 0, r.stdout[-2000:] + "\n" + r.stderr[-3000:]
    results = {}
    for name in dtypes:
        parts = [torch.load(tmp_path / f"{name}_rank{i}.pt") for i in range(len(lengths))]
        out = torch.cat([p["out"] for p in parts], 1)
        grads = [torch.cat([p["grads"][j] for p in parts], 1) for j in range(4)]
        results[name] = (out, grads)
    return results


def single_process(lengths, dtype, heads=4, kv_heads=4, head_dim=32, seed=0):
    q, k, v, lf, grad_out = full_inputs(lengths, heads, kv_heads, head_dim, dtype, seed, "cpu")
    leaves = [t.detach().clone().requires_grad_(True) for t in (q, k, v, lf)]
    out = forgetting_attention(*leaves)
    out.backward(grad_out)
    return out.detach(), [t.grad for t in leaves]


NAMES = ["out", "dq", "dk", "dv", "dlog_fgate"]


def check_bfloat16(lengths, out, grads, **shape):
    ref_out, ref_grads = single_process(lengths, torch.float64, **shape)
    naive_out, naive_grads = single_process(lengths, torch.bfloat16, **shape)
    problems = rule_violations(NAMES, [out] + grads, [ref_out] + ref_grads,
                               [naive_out] + naive_grads, torch.bfloat16)
    assert not problems, problems


@pytest.mark.parametrize("lengths,kv_heads", [
    ([40, 40], 4),             # 2 ranks
    ([33, 33, 20], 2),         # 3 ranks (not a power of two), a shorter last chunk, GQA
    ([17, 50, 9, 64], 1),      # 4 ranks of any lengths, MQA
])
def test_matches_single_process(tmp_path, lengths, kv_heads):
    """float64 to rounding; bf16 (3 and 4 ranks) within the 2x rule."""
    dtypes = ("float64",) if len(lengths) == 2 else ("float64", "bfloat16")
    results = run_ranks(tmp_path, lengths, dtypes, kv_heads=kv_heads)
    out, grads = results["float64"]
    ref_out, ref_grads = single_process(lengths, torch.float64, kv_heads=kv_heads)
    for name, got, ref in zip(NAMES, [out] + grads, [ref_out] + ref_grads):
        torch.testing.assert_close(got, ref, rtol=1e-10, atol=1e-10, msg=name)
    if "bfloat16" in results:
        check_bfloat16(lengths, *results["bfloat16"], kv_heads=kv_heads)


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")
def test_two_gpus_nccl(tmp_path):
    lengths = [256, 200]
    out, grads = run_ranks(tmp_path, lengths, ("bfloat16",), {"FOX_TEST_BACKEND": "nccl"},
                           kv_heads=2, head_dim=64)["bfloat16"]
    check_bfloat16(lengths, out, grads, kv_heads=2, head_dim=64)


def test_outside_a_process_group_is_a_clear_error():
    from forgetting_transformer.distributed import context_parallel_attention
    t = torch.zeros(1, 4, 2, 8)
    with pytest.raises(RuntimeError, match="init_process_group"):
        context_parallel_attention(t, t, t, torch.zeros(1, 4, 2))
