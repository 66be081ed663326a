"""The wheel works on its own: installed into a fresh virtual environment (the pinned packages such
as torch come from the base Python's site-packages; forgetting_transformer only from the wheel, and
no source tree on the path), it runs the op against the naive formula, trains a tiny model for a
few steps, runs the `fox` command, and serves a C++ app (tests/cpp/consumer) through its CMake
package. The wheel: FOX_WHEEL, else the newest dist/forgetting_transformer-*.whl (.ci/setup.sh
builds it); skipped when there is none."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from test_cmake_consumer import REPO_ROOT, build_and_run_consumer, run

pytestmark = pytest.mark.slow

CHECKS = r"""
import json, math, os, sys
import torch, torch.nn.functional as F
import forgetting_transformer as fox
from forgetting_transformer.nn import ForgettingTransformerConfig, ForgettingTransformerForCausalLM

def naive(q, k, v, g):
    T, D = q.shape[1], q.shape[-1]
    c = g.cumsum(1).transpose(1, 2)
    s = torch.einsum("bihd,bjhd->bhij", q, k) / math.sqrt(D) + c[..., :, None] - c[..., None, :]
    causal = torch.ones(T, T, dtype=torch.bool).tril()
    return torch.einsum("bhij,bjhd->bihd", s.masked_fill(~causal, float("-inf")).softmax(-1), v)

torch.manual_seed(0)
q, k, v = (torch.randn(2, 45, 2, 32, dtype=torch.float64, requires_grad=True) for _ in range(3))
g = F.logsigmoid(torch.randn(2, 45, 2, dtype=torch.float64) + 2).requires_grad_()
out = fox.forgetting_attention(q, k, v, g)
ref = naive(q, k, v, g)
assert (out - ref).abs().max().item() < 1e-10
grads = torch.autograd.grad(out.square().sum(), (q, k, v, g))
ref_grads = torch.autograd.grad(ref.square().sum(), (q, k, v, g))
assert all((a - b).abs().max().item() < 1e-9 for a, b in zip(grads, ref_grads))
assert torch.equal(torch.ops.fox.forgetting_attention(q, k, v, g), out)

config = ForgettingTransformerConfig(vocab_size=64, hidden_size=64, num_hidden_layers=2,
                                     num_heads=2).preset("fox_pro")
model = ForgettingTransformerForCausalLM(config)
opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
ids = torch.randint(0, 64, (2, 33))
losses = []
for _ in range(5):
    loss = model(ids[:, :-1], labels=ids[:, 1:]).mean()
    opt.zero_grad()
    loss.backward()
    opt.step()
    losses.append(loss.item())
assert all(math.isfinite(x) for x in losses) and losses[-1] < losses[0], losses

print(json.dumps({"file": fox.__file__, "with_cuda": fox.built_with_cuda(),
                  "prefix_path": fox.cmake_prefix_path + ";" + torch.utils.cmake_prefix_path,
                  "losses": losses}))
"""


def find_wheel() -> Path:
    if os.environ.get("FOX_WHEEL"):
        return Path(os.environ["FOX_WHEEL"])
    wheels = sorted((REPO_ROOT / "dist").glob("forgetting_transformer-*.whl"),
                    key=lambda p: p.stat().st_mtime)
    if not wheels:
        pytest.skip("no wheel in dist/ (pip wheel --no-build-isolation --no-deps -w dist .)")
    return wheels[-1]


def test_wheel_in_fresh_venv(tmp_path):
    wheel = find_wheel()
    venv = tmp_path / "venv"
    # From the base interpreter (also when this one is a virtual environment): its site-packages
    # hold torch & co.; the new environment's own site-packages, searched first, the wheel.
    base = getattr(sys, "_base_executable", sys.executable)
    run([base, "-m", "venv", "--system-site-packages", "--without-pip", venv])
    python, fox = venv / "bin" / "python", venv / "bin" / "fox"
    run([python, "-m", "pip", "install", "-q", "--disable-pip-version-check", "--no-deps",
         "--no-index", wheel])

    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTHON")}
    work = tmp_path / "work"  # the working directory: neither the source tree nor the venv
    work.mkdir()

    def venv_run(cmd, timeout=300):
        proc = subprocess.run([str(c) for c in cmd], cwd=work, env=env, capture_output=True,
                              text=True, timeout=timeout)
        assert proc.returncode == 0, f"{cmd}\n{proc.stdout[-4000:]}\n{proc.stderr[-4000:]}"
        return proc.stdout

    info = json.loads(venv_run([python, "-c", CHECKS]).strip().splitlines()[-1])
    package_dir = Path(info["file"]).resolve().parent
    assert venv.resolve() in package_dir.parents, f"imported {info['file']}, not the wheel's"

    assert "max |error|" in venv_run([fox, "demo", "--seqlen", "64", "--batch", "1",
                                      "--heads", "2", "--head-dim", "16"])

    build_and_run_consumer(tmp_path / "consumer", package_dir, info["prefix_path"],
                           info["with_cuda"])
