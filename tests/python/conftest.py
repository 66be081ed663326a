"""Shared fixtures of the Python tests: devices, per-test seeds and random inputs."""
import os
import sys
import zlib

import pytest
import torch
import torch.nn.functional as F

# Lets the tests `import reference` however pytest was started (rootdir, tests/python, a file).
sys.path.insert(0, os.path.dirname(__file__))

HAS_CUDA = torch.cuda.is_available()


def pytest_configure(config):
    """Under tests/run.sh the package must be the one installed from the wheel, not the source
    tree's forgetting_transformer/ (which a stray sys.path entry would bring in)."""
    if os.environ.get("FOX_TEST_INSTALLED") != "1":
        return
    import forgetting_transformer

    package = os.path.realpath(os.path.dirname(forgetting_transformer.__file__))
    source = os.path.realpath(os.path.join(os.path.dirname(__file__), "..", "..",
                                           "forgetting_transformer"))
    prefix = os.path.realpath(sys.prefix)
    if package == source or not package.startswith(prefix + os.sep):
        raise pytest.UsageError(f"forgetting_transformer imported from {package}, not from the "
                                f"installed package of {prefix}")

# CPU always; CUDA only where a GPU is visible (the tests carry the `cuda` marker, so
# `-m "not cuda"` / `-m cuda` select them).
DEVICES = [
    "cpu",
    pytest.param("cuda", marks=[pytest.mark.cuda,
                                pytest.mark.skipif(not HAS_CUDA, reason="no CUDA device")]),
]


@pytest.fixture(params=DEVICES)
def device(request):
    return request.param


@pytest.fixture(autouse=True)
def _fixed_seed(request):
    """Every test gets its own fixed seed (a hash of its id): reproducible runs, and no two
    parametrizations share their 'random' inputs. FOX_TEST_SEED=n shifts all seeds (to check
    that a result does not hinge on one draw)."""
    seed = zlib.crc32(request.node.nodeid.encode()) + int(os.environ.get("FOX_TEST_SEED", "0"))
    torch.manual_seed(seed)
    yield


# ---- inputs ------------------------------------------------------------------------------------

GATE_REGIMES = ("zero", "tiny", "normal", "strong", "mixed")


def make_log_fgate(B, T, H, regime="normal", device="cpu", dtype=torch.float32):
    """log f of shape (B, T, H), computed like a model does: logsigmoid of random logits in fp32.

    zero:   log f == 0 exactly (never forget: plain causal softmax attention)
    tiny:   log f ~ -1e-6 (the "almost never forget" end a trained model often reaches)
    normal: logits ~ N(2, 1.5^2): log f mostly in [-1, -0.01], attention spans tens of tokens
    strong: logits uniform in [-20, 2]: log f down to ~-20 (forget at once)
    mixed:  half the heads tiny, half strong (global and local heads side by side)
    """
    shape = (B, T, H)
    if regime == "zero":
        return torch.zeros(shape, device=device, dtype=dtype)
    if regime == "tiny":
        logits = 13.8 + 0.3 * torch.randn(shape)
    elif regime == "normal":
        logits = 2.0 + 1.5 * torch.randn(shape)
    elif regime == "strong":
        logits = torch.empty(shape).uniform_(-20.0, 2.0)
    elif regime == "mixed":
        tiny = 13.8 + 0.3 * torch.randn(shape)
        strong = torch.empty(shape).uniform_(-20.0, 2.0)
        logits = torch.where(torch.arange(H) % 2 == 0, tiny, strong)
    else:
        raise ValueError(f"unknown gate regime {regime!r}")
    return F.logsigmoid(logits.float()).to(device=device, dtype=dtype)


def make_inputs(B=2, Tq=33, Tk=None, H=2, Hkv=None, D=32, dtype=torch.float32, device="cpu",
                regime="normal", qk_scale=1.0):
    """Random (q, k, v, log_fgate) in the op's layout: q (B, Tq, H, D), k/v (B, Tk, Hkv, D),
    log_fgate (B, Tk, H) float32 (float64 with float64 q). Gaussian: never zeros."""
    Tk = Tq if Tk is None else Tk
    Hkv = H if Hkv is None else Hkv
    q = (qk_scale * torch.randn(B, Tq, H, D)).to(device=device, dtype=dtype)
    k = (qk_scale * torch.randn(B, Tk, Hkv, D)).to(device=device, dtype=dtype)
    v = torch.randn(B, Tk, Hkv, D).to(device=device, dtype=dtype)
    g_dtype = torch.float64 if dtype == torch.float64 else torch.float32
    log_fgate = make_log_fgate(B, Tk, H, regime, device=device, dtype=g_dtype)
    return q, k, v, log_fgate


@pytest.fixture
def inputs_factory():
    return make_inputs
