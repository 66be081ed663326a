"""Context parallelism (forgetting_transformer.distributed): 2, 3 and 4 CPU processes (gloo), each
with its part of the sequence (one contiguous chunk, or the zigzag layout's two), against the
single-process op on the whole sequence, forward and backward: float64 to rounding, bf16 within
the 2x rule of the single-process op's own error. On 2 GPUs (nccl) the same where a machine has
them."""
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
from forgetting_transformer.distributed import zigzag_shard, zigzag_unshard  # noqa: E402

pytestmark = pytest.mark.slow
WORKER = Path(__file__).parent / "context_parallel_worker.py"


def run_ranks(tmp_path, lengths, dtypes=("float64",), env_extra=None, ranks=None, **opts):
    """Runs the worker on len(lengths) processes (or `ranks`, with layout="zigzag" and lengths the
    whole sequence's); returns {dtype: (out, [dq, dk, dv, dlog_fgate])} with the ranks' parts put
    back in sequence order."""
    ranks = ranks or len(lengths)
    zigzag = opts.get("layout") == "zigzag"
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path), OMP_NUM_THREADS="1",
               **(env_extra or {}))
    env.pop("WORLD_SIZE", None)
    args = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(ranks),
            "--master_addr", "127.0.0.1", "--master_port", str(port), str(WORKER),
            "--lengths", *map(str, lengths), "--dtype", *dtypes, "--out-dir", str(tmp_path)]
    for key, value in opts.items():
        values = value if isinstance(value, (list, tuple)) else [value]
        args += [f"--{key.replace('_', '-')}", *map(str, values)]
    r = subprocess.run(args, capture_output=True, text=True, env=env, timeout=300)
    assert r.returncode == 0, r.stdout[-2000:] + "\n" + r.stderr[-3000:]
    results = {}
    for name in dtypes:
        parts = [torch.load(tmp_path / f"{name}_rank{i}.pt") for i in range(ranks)]
        join = zigzag_unshard if zigzag else (lambda ts: torch.cat(ts, 1))
        out = join([p["out"] for p in parts])
        grads = [join([p["grads"][j] for p in parts]) for j in range(4)]
        results[name] = (out, grads)
        for p in parts:  # the gathered sequence is not kept: local tensors and the lse only
            lse_bound = p["out"].shape[0] * p["out"].shape[1] * p["out"].shape[2] * 8
            assert 0 < p["saved_bytes"] <= p["local_bytes"] + lse_bound, (name, p["saved_bytes"])
        results.setdefault("sent_rows", {})[name] = [p["sent_rows"] for p in parts]
        results.setdefault("sent_head_rows", {})[name] = [p["sent_head_rows"] for p in parts]
    return results


def single_process(lengths, dtype, heads=4, kv_heads=4, head_dim=32, seed=0, gate_bias=2.0,
                   threshold=None):
    q, k, v, lf, grad_out = full_inputs(lengths, heads, kv_heads, head_dim, dtype, seed, "cpu",
                                        gate_bias)
    leaves = [t.detach().clone().requires_grad_(True) for t in (q, k, v, lf)]
    out = forgetting_attention(*leaves, adaptive_threshold=threshold)
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


@pytest.mark.parametrize("ranks,total,kv_heads", [
    (2, 80, 4),     # 4 chunks of 20
    (3, 86, 2),     # 6 chunks of 15, 15, 14, 14, 14, 14: uneven, GQA
    (4, 61, 1),     # 8 chunks of 8 and 7, MQA
])
def test_zigzag_matches_single_process(tmp_path, ranks, total, kv_heads):
    """The zigzag layout (rank r holds chunks r and 2P-1-r): float64 to rounding, bf16 (3 and 4
    ranks) within the 2x rule."""
    dtypes = ("float64",) if ranks == 2 else ("float64", "bfloat16")
    results = run_ranks(tmp_path, [total], dtypes, ranks=ranks, kv_heads=kv_heads,
                        layout="zigzag")
    out, grads = results["float64"]
    ref_out, ref_grads = single_process([total], torch.float64, kv_heads=kv_heads)
    for name, got, ref in zip(NAMES, [out] + grads, [ref_out] + ref_grads):
        torch.testing.assert_close(got, ref, rtol=1e-10, atol=1e-10, msg=name)
    if "bfloat16" in results:
        check_bfloat16([total], *results["bfloat16"], kv_heads=kv_heads)


@pytest.mark.parametrize("groups,ranks,lengths,layout,heads,kv_heads", [
    ("2", 2, [30, 25], "contiguous", 4, 4),   # 2 groups of 2 heads
    ("3", 3, [62], "zigzag", 4, 2),           # 3 asked, 2 KV heads: 2 groups of 1 KV head + 2 q heads
    ("4", 2, [41, 40], "contiguous", 8, 4),   # 4 groups of 1 KV head and its 2 query heads
])
def test_head_groups_match_single_process(tmp_path, groups, ranks, lengths, layout, heads,
                                          kv_heads):
    """FOX_CP_HEAD_GROUPS: attention run head group after head group (each group's gather and
    gradient reduction in flight during another group's work): the same result as one process
    (float64 to rounding, bf16 by the 2x rule)."""
    results = run_ranks(tmp_path, lengths, ("float64", "bfloat16"), ranks=ranks, layout=layout,
                        heads=heads, kv_heads=kv_heads, env_extra={"FOX_CP_HEAD_GROUPS": groups})
    out, grads = results["float64"]
    ref_out, ref_grads = single_process([sum(lengths)], torch.float64, heads=heads,
                                        kv_heads=kv_heads)
    for name, got, ref in zip(NAMES, [out] + grads, [ref_out] + ref_grads):
        torch.testing.assert_close(got, ref, rtol=1e-10, atol=1e-10, msg=name)
    check_bfloat16([sum(lengths)], *results["bfloat16"], heads=heads, kv_heads=kv_heads)


@pytest.mark.parametrize("ranks,lengths,layout,sent", [
    # log f ~ -3 a position: a piece ~60 below the threshold of -15 once a piece lies between.
    (4, [20, 20, 20, 20], "contiguous", [20, 20, 20, 0]),  # each piece to the next rank only
    (3, [60], "zigzag", None),   # chunks of 10: r and 5-r; rank 0's late chunk needs 3 and 4
])
def test_pruning_across_ranks(tmp_path, ranks, lengths, layout, sent):
    """With adaptive_threshold, a piece whose largest bias to every query of a rank is below the
    threshold for every head is neither sent to that rank nor attended to: the result equals the
    single-process op with the same threshold (float64 to rounding, bf16 by the 2x rule), fewer
    rows travel than the all-gather's (P - 1) per row, and FOX_CP_PRUNE=0 (the all-gather) gives
    the same result."""
    opts = dict(threshold=-15.0, gate_bias=-3.0, layout=layout)
    total = sum(lengths)
    (tmp_path / "pruned").mkdir()
    (tmp_path / "gathered").mkdir()
    results = run_ranks(tmp_path / "pruned", lengths, ("float64", "bfloat16"), ranks=ranks,
                        **opts)
    plain = run_ranks(tmp_path / "gathered", lengths, ranks=ranks,
                      env_extra={"FOX_CP_PRUNE": "0"}, **opts)
    ref_out, ref_grads = single_process([total], torch.float64, gate_bias=-3.0, threshold=-15.0)
    for got in (results["float64"], plain["float64"]):
        for name, a, b in zip(NAMES, [got[0]] + got[1], [ref_out] + ref_grads):
            torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-10, msg=name)
    check_bfloat16([total], *results["bfloat16"], gate_bias=-3.0, threshold=-15.0)
    rows = results["sent_rows"]["float64"]
    assert all(len(r) == 1 and r[0] is not None for r in rows), rows  # one plan, pruning
    sent_rows = [r[0] for r in rows]
    all_gather_rows = (ranks - 1) * total
    assert sum(sent_rows) < all_gather_rows, (sent_rows, all_gather_rows)
    if sent is not None:
        assert sent_rows == sent
    assert plain["sent_rows"]["float64"] == [[] for _ in range(ranks)]


@pytest.mark.parametrize("ranks,lengths,layout,heads,kv_heads,gate_bias", [
    # 4 KV heads: 0 and 2 forget fast (log f ~ -3), 1 and 3 slowly (~ -0.1): only the slow ones
    # travel past the neighbouring piece.
    (4, [20, 20, 20, 20], "contiguous", 4, 4, [-3.0, 2.0, -3.0, 2.0]),
    # GQA, 2 query heads a KV head: KV head 0's heads both fast; KV head 1 has one slow head,
    # which keeps the whole group.
    (3, [60], "zigzag", 4, 2, [-3.0, -3.0, -3.0, 2.0]),
])
def test_pruning_across_ranks_head_by_head(tmp_path, ranks, lengths, layout, heads, kv_heads,
                                           gate_bias):
    """FOX_CP_PRUNE_HEADS=1, a layer whose heads forget at different rates: each KV head's K, V
    and gates travel only as far back as that head (or a query head of its group) can reach the
    threshold. Same result as the single-process op (float64 to rounding, bf16 by the 2x rule);
    fewer rows x heads travel than whole rows of every head would."""
    opts = dict(threshold=-15.0, gate_bias=gate_bias, layout=layout, heads=heads,
                kv_heads=kv_heads)
    total = sum(lengths)
    results = run_ranks(tmp_path, lengths, ("float64", "bfloat16"), ranks=ranks,
                        env_extra={"FOX_CP_PRUNE_HEADS": "1"}, **opts)
    shape = dict(heads=heads, kv_heads=kv_heads, gate_bias=gate_bias, threshold=-15.0)
    ref_out, ref_grads = single_process([total], torch.float64, **shape)
    got = results["float64"]
    for name, a, b in zip(NAMES, [got[0]] + got[1], [ref_out] + ref_grads):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-10, msg=name)
    check_bfloat16([total], *results["bfloat16"], **shape)
    rows = [r[0] for r in results["sent_rows"]["float64"]]
    head_rows = [r[0] for r in results["sent_head_rows"]["float64"]]
    assert None not in rows and None not in head_rows, (rows, head_rows)
    # the slow heads reach further than the neighbouring piece: more rows than the fast
    # heads alone need, but fewer rows x heads than sending every head of them
    assert sum(head_rows) < kv_heads * sum(rows), (rows, head_rows)
    assert sum(rows) < (ranks - 1) * total
    # the default plans the layer's heads together: the same result; a slow head keeps every
    # piece for every head here, so the plan prunes nothing (the all-gather)
    (tmp_path / "layer").mkdir()
    layer = run_ranks(tmp_path / "layer", lengths, ranks=ranks, **opts)
    for name, a, b in zip(NAMES, [layer["float64"][0]] + layer["float64"][1], [ref_out] + ref_grads):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-10, msg=name)
    assert layer["sent_rows"]["float64"] == [[None]] * ranks


def run_in_group_of_one(code):
    """Runs `code` in a fresh Python process inside a gloo process group of one (`torch` and
    `dist` imported); it passes by reaching its end."""
    script = ("import socket, torch, torch.distributed as dist\n"
              "s = socket.socket(); s.bind(('127.0.0.1', 0)); port = s.getsockname()[1]; "
              "s.close()\n"
              "dist.init_process_group('gloo', init_method=f'tcp://127.0.0.1:{port}', rank=0, "
              "world_size=1)\n" + code + "\ndist.destroy_process_group()\nprint('ok')\n")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
    r = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env,
                       timeout=120)
    assert r.returncode == 0 and "ok" in r.stdout, r.stdout[-2000:] + r.stderr[-3000:]


def test_pruning_plan_needs_forget_gates():
    """The plan of pruning across ranks, in a process group of one: adjacent pieces are always
    needed; with three pieces and gates that forget fast, the last one's queries skip the first;
    one positive log f (not a forget gate: the bound no longer holds) turns the plan off."""
    code = """
from forgetting_transformer import distributed
g = torch.full((1, 20, 2), -3.0)
where = distributed._layout(20, None, g.device, "zigzag", "test")
plan = distributed._PrunedExchange(g, None, where, -15.0)
assert not plan.prunes and plan.first == [[0, 0], [0, 0]], plan.first  # adjacent: always
g3 = torch.full((1, 30, 2), -3.0)
where3 = distributed._layout(30, None, g3.device, "contiguous", "test")
where3.pieces = [(0, 0, 0, 10), (10, 0, 10, 10), (20, 0, 20, 10)]  # three pieces on one rank
where3.mine = [(0, 0, 10), (10, 10, 10), (20, 20, 10)]
plan = distributed._PrunedExchange(g3, None, where3, -15.0)
assert plan.prunes and plan.first == [[0, 0], [0, 0], [1, 1]], plan.first  # 2 skips 0
g3[0, 5, 1] = 0.5
plan = distributed._PrunedExchange(g3, None, where3, -15.0)
assert not plan.prunes
"""
    run_in_group_of_one(code)


def test_zigzag_shard_round_trip():
    x = torch.arange(2 * 23 * 3).view(2, 23, 3)
    shards = [zigzag_shard(x, r, 3) for r in range(3)]
    assert [s.shape[1] for s in shards] == [4 + 3, 4 + 4, 4 + 4]  # chunks 4,4,4,4,4,3: r and 5-r
    assert torch.equal(zigzag_unshard(shards), x)


@pytest.mark.cuda
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")
@pytest.mark.parametrize("layout,pruning", [("contiguous", False), ("zigzag", False),
                                            ("zigzag", True)])
def test_two_gpus_nccl(tmp_path, layout, pruning):
    # pruning: pruning across ranks head by head (KV head 0's heads forget fast, KV head 1 keeps
    # one slow head): the all_to_all of uneven, per-head parts over nccl
    lengths = [256, 200] if layout == "contiguous" else [456]
    extra = dict(threshold=-15.0, gate_bias=[-3.0, -3.0, -3.0, 2.0]) if pruning else {}
    env = {"FOX_TEST_BACKEND": "nccl", "FOX_CP_PRUNE_HEADS": "1"}
    results = run_ranks(tmp_path, lengths, ("bfloat16",), env,
                        ranks=2, kv_heads=2, head_dim=64, layout=layout, **extra)
    check_bfloat16([456], *results["bfloat16"], kv_heads=2, head_dim=64, **extra)
    if pruning:
        assert all(r[0] is not None for r in results["sent_rows"]["bfloat16"])


def test_bad_layouts_are_clear_errors():
    """In a process group of one (gloo): an unknown layout, a sequence too short for the zigzag
    chunks and a head group count that is not a number are ValueErrors that say what was
    expected."""
    code = """
from forgetting_transformer.distributed import context_parallel_attention
from forgetting_transformer import forgetting_attention
t, g = torch.randn(1, 5, 2, 8), torch.nn.functional.logsigmoid(torch.randn(1, 5, 2))
try:
    context_parallel_attention(t, t, t, g, layout="ring")
except ValueError as e:
    assert "layout must be" in str(e), e
else:
    raise AssertionError("layout='ring'")
# a group of one holds both zigzag chunks: the op on the whole sequence, to rounding (the second
# chunk's queries are their own op call against the whole prefix)
torch.testing.assert_close(context_parallel_attention(t, t, t, g, layout="zigzag"),
                           forgetting_attention(t, t, t, g))
t1, g1 = torch.zeros(1, 1, 2, 8), torch.zeros(1, 1, 2)
try:  # one position cannot be cut into the 2 chunks of a group of one
    context_parallel_attention(t1, t1, t1, g1, layout="zigzag")
except ValueError as e:
    assert "at least 2 positions" in str(e), e
else:
    raise AssertionError("1 position")
import os
os.environ["FOX_CP_HEAD_GROUPS"] = "two"
try:
    context_parallel_attention(t, t, t, g)
except ValueError as e:
    assert "FOX_CP_HEAD_GROUPS must be a whole number >= 1, got 'two'" in str(e), e
else:
    raise AssertionError("FOX_CP_HEAD_GROUPS=two")
"""
    run_in_group_of_one(code)


def test_outside_a_process_group_is_a_clear_error():
    from forgetting_transformer.distributed import context_parallel_attention
    t = torch.zeros(1, 4, 2, 8)
    with pytest.raises(RuntimeError, match="init_process_group"):
        context_parallel_attention(t, t, t, torch.zeros(1, 4, 2))


# ---- the model under context parallelism (set_context_parallel) ---------------------------------

MODEL_WORKER = Path(__file__).parent / "context_parallel_model_worker.py"


def run_model_ranks(tmp_path, ranks, lengths, **opts):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path), OMP_NUM_THREADS="1")
    env.pop("WORLD_SIZE", None)
    args = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(ranks),
            "--master_addr", "127.0.0.1", "--master_port", str(port), str(MODEL_WORKER),
            "--lengths", *map(str, lengths), "--out-dir", str(tmp_path)]
    for key, value in opts.items():
        args += [f"--{key.replace('_', '-')}", str(value)]
    r = subprocess.run(args, capture_output=True, text=True, env=env, timeout=300)
    assert r.returncode == 0, r.stdout[-2000:] + "\n" + r.stderr[-3000:]
    return [torch.load(tmp_path / f"rank{i}.pt") for i in range(ranks)]


@pytest.mark.parametrize("arch,ranks,lengths,layout,extra", [
    ("fox_pro", 2, [23, 18], "contiguous", {}),
    ("fox_pro", 3, [40], "zigzag", {"kv_heads": 2}),
    ("fox_llama", 3, [9, 30, 14], "contiguous", {"kv_heads": 1}),
    ("transformer_pro", 2, [37], "zigzag", {}),
    ("transformer_llama", 2, [20, 20], "contiguous", {}),
    ("fox_pro", 2, [44], "zigzag", {"pruning": -10.0}),
    ("fox_pro", 2, [21, 19], "contiguous", {"checkpointing": 1}),
    ("fox_pro", 3, [36], "zigzag", {"overlap": 0}),
    ("fox_llama", 2, [30, 26], "contiguous", {"head_groups": 2}),
    ("fox_pro", 3, [60], "zigzag", {"pruning": -10.0, "gate_bias": -4.0}),  # across ranks
    ("fox_pro", 3, [60], "zigzag", {"pruning": -10.0, "gate_bias": -4.0, "overlap": 0}),
    ("fox_pro", 2, [44], "zigzag", {"pruning": -10.0, "gate_bias": -4.0, "checkpointing": 1}),
])
def test_model_matches_single_process(tmp_path, arch, ranks, lengths, layout, extra):
    """Every preset run context-parallel (its KV-shift across ranks, RoPE at global positions,
    the pruning threshold agreed over the ranks, with per-block checkpointing, with the backward
    prefetch and reduce-scatter turned off): the per-token losses equal those of the whole
    sequence in one process, and every parameter gradient summed over the ranks equals the
    single-process one (float64, to rounding). The backward prefetches the gather of layer 1
    while layer 2's backward runs, except where checkpointing frees the tensors or it is off."""
    from context_parallel_model_worker import build, inputs
    parts = run_model_ranks(tmp_path, ranks, lengths, arch=arch, layout=layout, **extra)
    join = zigzag_unshard if layout == "zigzag" else (lambda ts: torch.cat(ts, 1))
    loss = join([p["loss"] for p in parts])
    model = build(arch, torch.float64, extra.get("kv_heads"), extra.get("pruning"),
                  gate_bias=extra.get("gate_bias"))
    ids, labels, weights = inputs(sum(lengths))
    ref = model(ids, labels=labels)
    (ref * weights).sum().backward()
    torch.testing.assert_close(loss, ref.detach(), rtol=1e-10, atol=1e-12)
    for name, p in model.named_parameters():
        got = sum(part["grads"][name] for part in parts)
        torch.testing.assert_close(got, p.grad, rtol=1e-9, atol=1e-12, msg=name)
    prefetching = extra.get("overlap", 1) and not extra.get("checkpointing")
    assert [p["prefetches"] for p in parts] == [1 if prefetching else 0] * ranks
    # Fast gates under pruning take the pruned exchange in both layers (prefetched as well;
    # under checkpointing a layer's recompute plans again).
    pruned_calls = (4 if extra.get("checkpointing") else 2) if "gate_bias" in extra else 0
    assert [p["pruned"] for p in parts] == [pruned_calls] * ranks


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)])
def test_model_context_parallel_in_a_group_of_one(device):
    """In a process group of one (gloo; nccl on a GPU, bf16): the context-parallel model equals
    the plain one (bit for bit with one contiguous chunk; to rounding with zigzag's two pieces),
    and its gradients too; on CPU also: a cache or seq_start is a clear error, a bad layout a
    ValueError, and layout=None turns it off."""
    if device == "cuda" and not torch.cuda.is_available():
        pytest.skip("needs a GPU")
    code = """
import socket, sys, torch, torch.distributed as dist
device = sys.argv[1]
s = socket.socket(); s.bind(("127.0.0.1", 0)); port = s.getsockname()[1]; s.close()
dist.init_process_group("nccl" if device == "cuda" else "gloo",
                        init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
from forgetting_transformer.distributed import set_context_parallel
from forgetting_transformer.nn import ForgettingTransformerConfig, ForgettingTransformerForCausalLM
config = ForgettingTransformerConfig(vocab_size=50, hidden_size=64, num_hidden_layers=2,
                                     num_heads=4).preset("fox_pro")
model = ForgettingTransformerForCausalLM(config).to(device)
if device == "cuda":
    model = model.to(torch.bfloat16)
ids = torch.randint(0, 50, (2, 100), device=device)
def run():
    model.zero_grad()
    out = model(ids)
    out.float().square().mean().backward()
    return out.detach(), [p.grad.clone() for p in model.parameters()]
plain, plain_grads = run()
set_context_parallel(model)
out, grads = run()
assert torch.equal(out, plain)
assert all(torch.equal(a, b) for a, b in zip(grads, plain_grads))
set_context_parallel(model, layout="zigzag")   # two pieces: the queries in two calls
out, grads = run()
tol = 1e-5 if device == "cpu" else 2e-2
torch.testing.assert_close(out, plain, rtol=tol, atol=tol)
for a, b in zip(grads, plain_grads):
    torch.testing.assert_close(a, b, rtol=tol, atol=tol * float(b.abs().max()))
if device == "cpu":
    for kwargs in ({"cache": model.new_cache()}, {"seq_start": torch.tensor([0, 2])}):
        try:
            model(ids, **kwargs)
        except RuntimeError as e:
            assert "neither a cache nor seq_start" in str(e), e
        else:
            raise AssertionError(kwargs)
    try:
        set_context_parallel(model, layout="ring")
    except ValueError as e:
        assert "layout must be" in str(e), e
    else:
        raise AssertionError("layout='ring'")
    try:
        set_context_parallel(torch.nn.Linear(2, 2))
    except TypeError as e:
        assert "ForgettingTransformerForCausalLM" in str(e), e
    else:
        raise AssertionError("a torch.nn.Linear")
set_context_parallel(model, layout=None)
model(ids[:, :10], cache=model.new_cache())
dist.destroy_process_group()
print("ok")
"""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
    r = subprocess.run([sys.executable, "-c", code, device], capture_output=True, text=True,
                       env=env, timeout=120)
    assert r.returncode == 0 and "ok" in r.stdout, r.stdout[-2000:] + r.stderr[-3000:]


@pytest.mark.parametrize("extra,switch", [
    ([], "FOX_CP_OVERLAP=0"),
    (["--forget", "-0.05"], "FOX_CP_PRUNE=0"),
    (["--forget", "-0.5", "--global-heads", "2"], "FOX_CP_PRUNE_HEADS=1"),
])
def test_context_parallel_benchmark_runs(extra, switch):
    """bench/bench_context_parallel.py on 2 CPU processes with its toy model (a smoke test of the
    script that measures the model under context parallelism on GPUs), also in its pruning mode
    (every head forgetting fast)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path), OMP_NUM_THREADS="1")
    env.pop("WORLD_SIZE", None)
    script = Path(__file__).parents[2] / "bench" / "bench_context_parallel.py"
    r = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2",
                        "--master_addr", "127.0.0.1", "--master_port", str(port), str(script),
                        "--device", "cpu", "--tiny", "--seqlen", "64", "--reps", "1",
                        "--ab", switch, *extra],
                       capture_output=True, text=True, env=env, timeout=300)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
    assert "| 2 | 64 | default |" in r.stdout and f"| 2 | 64 | {switch} |" in r.stdout, r.stdout
    assert ("every head at log f = -0" in r.stdout) == bool(extra), r.stdout
    assert ("but 2 a layer at -1e-5" in r.stdout) == ("--global-heads" in extra), r.stdout


def test_benchmark_forget_rate():
    """The benchmark's --forget sets every forget gate to the constant log f asked for: the gate
    projections' weights zero, logsigmoid(bias) = log f; --global-heads N keeps the first N heads
    of each layer at log f = -1e-5."""
    sys.path.insert(0, str(Path(__file__).parents[2] / "bench"))
    from bench_context_parallel import set_forget_rate
    from context_parallel_model_worker import build
    model = build("fox_pro", torch.float64)
    set_forget_rate(model, -0.05)
    gates = {n: p for n, p in model.named_parameters() if "fgate_proj" in n}
    assert gates
    for name, p in gates.items():
        if name.endswith("bias"):
            torch.testing.assert_close(torch.nn.functional.logsigmoid(p),
                                       torch.full_like(p, -0.05), rtol=1e-12, atol=1e-12)
        else:
            assert not p.any(), name
    set_forget_rate(model, -0.05, global_heads=1)
    for name, p in gates.items():
        if name.endswith("bias"):
            expected = torch.full_like(p, -0.05)
            expected[0] = -1e-5
            torch.testing.assert_close(torch.nn.functional.logsigmoid(p), expected, rtol=1e-9,
                                       atol=1e-12)


def test_exposed_communication_time():
    """The benchmark's exposed time: the part of the collectives' spans that no other kernel
    covers (spans overlapping among themselves counted once)."""
    sys.path.insert(0, str(Path(__file__).parents[2] / "bench"))
    from bench_context_parallel import exposed_time
    assert exposed_time([(0, 10)], []) == (10, 10)
    assert exposed_time([(0, 10)], [(2, 4), (3, 5), (8, 12)]) == (10, 5)   # 0-2, 5-8 bare
    assert exposed_time([(0, 4), (2, 6), (10, 12)], [(5, 11)]) == (8, 6)  # 0-5, 11-12 bare
    assert exposed_time([(0, 10)], [(-5, 20)]) == (10, 0)
