"""FSDP2 (torch.distributed.fsdp.fully_shard) on the C++ models: sharding in one process, and
`fox train --fsdp` with 2 CPU processes (gloo) under torchrun against a single-process run on the
same global batches, with checkpoints and resume."""
import json
import shutil

import pytest
import torch
import torch.distributed as dist

from forgetting_transformer import cli
from forgetting_transformer import nn as fnn
from forgetting_transformer.cli.train import load_checkpoint, models_from_checkpoint
from torchrun import torchrun_train

# CPU (gloo) even where GPUs exist: test_cli.py's two-GPU test covers nccl.
FLAGS = ["--preset", "micro", "--device", "cpu", "--threads", "1", "--steps", "6", "--batch-size", "4",
         "--micro-batch-size", "1", "--log-interval", "1", "--eval-interval", "3",
         "--checkpoint-interval", "3"]


def tiny():
    c = fnn.ForgettingTransformerConfig(vocab_size=53, hidden_size=32, num_hidden_layers=2,
                                        num_heads=4).preset("fox_pro")
    c.intermediate_size = 48
    return c


@pytest.fixture
def one_process_group():
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield
    dist.destroy_process_group()


@pytest.mark.filterwarnings("ignore:FSDP2-wrapped module")   # the per-token loss is a view
def test_fully_shard_one_process(one_process_group, tmp_path):
    """fully_shard per block then the root: parameters become DTensors in the C++ modules, three
    AdamW steps equal those of the unsharded twin; save_pretrained writes the full tensors and
    load_state_dict takes full tensors."""
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor
    torch.manual_seed(0)
    ref = fnn.ForgettingTransformerForCausalLM(tiny())
    model = fnn.ForgettingTransformerForCausalLM(tiny())
    model.load_state_dict(ref.state_dict())
    from torch.distributed.device_mesh import init_device_mesh
    mesh = init_device_mesh("cpu", (1,))  # (the default mesh would follow a GPU if there is one)
    for block in model.model.layers:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    assert all(isinstance(p, DTensor) for p in model.parameters())
    assert isinstance(model.model.layers[1].attn.q_proj.weight, DTensor)
    # as block 1 starts, its parameters are unsharded, block 0's resharded again
    seen = []
    model.model.layers[1].register_forward_pre_hook(lambda *_: seen.append(
        [type(b.attn.q_proj.weight) is DTensor for b in model.model.layers]))
    opts = [torch.optim.AdamW(m.parameters(), lr=1e-2) for m in (model, ref)]
    for _ in range(3):
        ids, labels = torch.randint(0, 53, (2, 9)), torch.randint(0, 53, (2, 9))
        losses = []
        for m, opt in zip((model, ref), opts):
            loss = m(ids, labels=labels).mean()
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses.append(loss.item())
        assert losses[0] == pytest.approx(losses[1], abs=1e-6)
    assert seen == [[True, False]] * 3
    assert all(isinstance(p, DTensor) for p in model.parameters())   # resharded after backward
    for (k, a), b in zip(model.state_dict().items(), ref.state_dict().values()):
        assert torch.allclose(a.full_tensor(), b, atol=1e-6), k
    model.save_pretrained(tmp_path / "hf")
    saved = fnn.ForgettingTransformerForCausalLM.from_pretrained(tmp_path / "hf")
    for (k, a), b in zip(saved.state_dict().items(), ref.state_dict().values()):
        assert torch.allclose(a, b, atol=1e-6), k
    fresh = fnn.ForgettingTransformerForCausalLM(tiny()).state_dict()
    model.load_state_dict(fresh)
    assert all(torch.equal(a.full_tensor(), fresh[k]) for k, a in model.state_dict().items())


def _metrics(run):
    rows = [json.loads(line) for line in open(run / "metrics.jsonl")]
    train = {r["step"]: r for r in rows if not r.get("eval")}
    evals = {r["step"]: r for r in rows if r.get("eval")}
    return train, evals


def _checkpoint(run):
    """The run's latest checkpoint (the one checkpoints/last names) as one dict."""
    return load_checkpoint(str(run))


def _rewind(run, step):
    """Points the run's checkpoints/last back at an earlier step directory."""
    (run / "checkpoints" / "last").write_text(f"step_{step:07d}\n")


def _assert_close_checkpoints(a, b, atol):
    assert a["step"] == b["step"]
    for arch in a["models"]:
        sa, sb = a["models"][arch]["state_dict"], b["models"][arch]["state_dict"]
        assert sa.keys() == sb.keys()
        for k in sa:
            assert type(sa[k]) is torch.Tensor and sa[k].shape == sb[k].shape, k
            assert torch.allclose(sa[k], sb[k], atol=atol, rtol=0), f"{arch} {k}"
        oa, ob = a["models"][arch]["optimizer"], b["models"][arch]["optimizer"]
        assert oa["param_groups"] == ob["param_groups"] and oa["state"].keys() == ob["state"].keys()
        for i in oa["state"]:
            for k, v in oa["state"][i].items():
                assert type(v) is torch.Tensor
                assert torch.allclose(v, ob["state"][i][k], atol=atol, rtol=0), f"{arch} {i} {k}"


def test_torchrun_fsdp_matches_single_process_and_resumes(tmp_path):
    fsdp, one = tmp_path / "fsdp", tmp_path / "one"
    r = torchrun_train([*FLAGS, "--fsdp", "--out-dir", str(fsdp)])
    assert "FSDP2 over 2 processes" in r.stdout
    assert json.load(open(fsdp / "run_info.json"))["fsdp"] is True
    assert cli.main(["train", *FLAGS, "--out-dir", str(one)]) == 0

    # the same losses, gradient norms and validation losses as one process on the global batch
    (tf, ef), (to, eo) = _metrics(fsdp), _metrics(one)
    assert sorted(tf) == list(range(1, 7)) and sorted(ef) == [3, 6]   # rank 0 alone wrote them
    for arch in ("fox_pro", "transformer_pro"):
        for s in tf:
            assert tf[s][arch]["loss"] == pytest.approx(to[s][arch]["loss"], abs=2e-4)
            assert tf[s][arch]["grad_norm"] == pytest.approx(to[s][arch]["grad_norm"], abs=2e-4)
        assert tf[6][arch]["loss"] < tf[1][arch]["loss"] - 0.2                  # it learns
        assert ef[6][arch]["val_loss"] == pytest.approx(eo[6][arch]["val_loss"], abs=2e-4)

    # the checkpoint holds full tensors in the single-process layout, with the same values
    _assert_close_checkpoints(_checkpoint(fsdp), _checkpoint(one), atol=1e-5)
    models = models_from_checkpoint(_checkpoint(fsdp))
    assert set(models) == {"fox_pro", "transformer_pro"}
    hf = fnn.ForgettingTransformerForCausalLM.from_pretrained(
        fsdp / "checkpoints" / "step_0000006" / "fox_pro", strict=True)
    assert all(torch.equal(v, models["fox_pro"].state_dict()[k]) for k, v in hf.state_dict().items())

    # resume under FSDP from the step-3 checkpoint: the uninterrupted run, bitwise
    resumed = tmp_path / "resumed"
    shutil.copytree(fsdp, resumed)
    _rewind(resumed, 3)
    shutil.rmtree(resumed / "checkpoints" / "step_0000006")
    torchrun_train([*FLAGS, "--fsdp", "--resume", "--out-dir", str(resumed)])
    a, b = _checkpoint(fsdp), _checkpoint(resumed)
    _assert_close_checkpoints(a, b, atol=0.0)
    assert sorted(_metrics(resumed)[0]) == list(range(1, 7))

    # an FSDP checkpoint resumes in one process too (and the other way round); step_0000006/ is
    # still there and is replaced by the new one
    cross = tmp_path / "cross"
    shutil.copytree(resumed, cross)
    _rewind(cross, 3)
    assert cli.main(["train", *FLAGS, "--resume", "--out-dir", str(cross)]) == 0
    _assert_close_checkpoints(_checkpoint(cross), a, atol=1e-5)


def test_fsdp_without_torchrun_is_one_process(tmp_path, capsys):
    assert cli.main(["train", "--preset", "micro", "--threads", "1", "--steps", "2", "--fsdp",
                     "--out-dir", str(tmp_path / "f")]) == 0
    assert "nothing to shard" in capsys.readouterr().out
    assert json.load(open(tmp_path / "f" / "run_info.json"))["fsdp"] is False
