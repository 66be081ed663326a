"""`fox train`: train FoX and the Transformer side by side on the same batches.

Each step draws one batch (a pure function of seed and step) and takes one optimizer step of
every model on it: AdamW (betas 0.9/0.95, weight decay on matrices only), gradient clipping,
linear warmup then cosine decay. Every ``checkpoint_interval`` steps a checkpoint directory
checkpoints/step_XXXXXXX/ is written: per model <arch>/config.json + <arch>/model.safetensors (the
Hugging Face format of save_pretrained / from_pretrained) and trainer_state.pt (optimizer states,
step, config, RNG, data state). It is built under a temporary name and renamed into place, then
the pointer checkpoints/last is replaced, so a kill leaves the previous checkpoint intact;
``--resume`` continues from the pointed-at one bitwise-identically on CPU.

Data parallel: under ``torchrun --nproc_per_node N`` (WORLD_SIZE > 1) every model is wrapped in
DistributedDataParallel (gloo on CPU, nccl on CUDA, one GPU per LOCAL_RANK). Every rank draws the
same global batch and takes its own contiguous slice of ``batch_size / N`` sequences; gradients are
all-reduced so the update equals the single-process one on the global batch. Only rank 0 writes
metrics, TensorBoard events and checkpoints.

FSDP2 (``--fsdp`` under torchrun): ``fully_shard`` on every block, then on the whole model, over
a 1-D mesh of all ranks. Each rank keeps a 1/N shard of every parameter, gradient and optimizer
state; a block's parameters are all-gathered just before it runs (forward and backward) and freed
after. Batches are split as with DDP, so the update is the single-process one. Checkpoints hold
the full (gathered) model and optimizer state, in the same layout as single-process and DDP runs:
any of the three can resume any checkpoint, and eval/generate read it unchanged.

Context parallelism (``--context-parallel P`` under torchrun, P dividing the number of processes):
ranks k*P .. k*P + P - 1 form a context-parallel group that shares one slice of the batch, and
every rank of it holds a part of each sequence (``--context-parallel-layout``: zigzag, two chunks
of 2P a rank so that causal work is balanced, or contiguous); the model runs through
forgetting_transformer.distributed.set_context_parallel. Data parallelism (DDP or FSDP2) runs over
all processes as above: each rank's loss is its tokens' share of the global batch's mean, so the
all-reduced gradients are the single-process ones. Validation runs on whole sequences.
"""
import contextlib
import json
import math
import os
import re
import shutil
import sys
import time
import warnings
from typing import Dict, List, Optional

import torch

from . import config as cfgmod
from .data import ByteCorpus, make_corpus

# /2: a directory of safetensors (per model) + trainer_state.pt; /1: one torch.save file.
CHECKPOINT_FORMAT = "fox_torch.cli/2"
CHECKPOINT_FORMATS = ("fox_torch.cli/1", CHECKPOINT_FORMAT)
# Keys that define the models and the data stream: a resumed run must agree on them.
STRUCTURAL_KEYS = ("models", "vocab_size", "hidden_size", "num_hidden_layers", "num_heads",
                   "hidden_ratio", "rope_base", "seq_len", "batch_size", "seed", "val_fraction",
                   "max_files")


def resolve_device(cfg) -> torch.device:
    if cfg["device"] == "auto":
        dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    else:
        dev = torch.device(cfg["device"])
    if dev.type == "cuda" and dev.index is None and int(os.environ.get("WORLD_SIZE", "1")) > 1:
        local_rank = int(os.environ.get("LOCAL_RANK", "0"))
        if local_rank >= torch.cuda.device_count():
            raise SystemExit(f"device: local rank {local_rank} needs a GPU of its own, but "
                             f"{torch.cuda.device_count()} are visible; start at most that many "
                             "processes per node, or pass --device cpu")
        dev = torch.device("cuda", local_rank)
    return dev


class Distributed:
    """torchrun's environment: rank, world size; initializes the process group when WORLD_SIZE > 1."""

    def __init__(self, device: torch.device, fsdp: bool = False, context_parallel: int = 1):
        import torch.distributed as dist
        self.dist = dist
        self.world = int(os.environ.get("WORLD_SIZE", "1"))
        self.rank = int(os.environ.get("RANK", "0"))
        self.owned = False
        if self.world > 1 and not dist.is_initialized():
            if device.type == "cuda":
                torch.cuda.set_device(device)
            # gloo next to nccl: the loss sums and checkpoint gathers run on CPU tensors
            dist.init_process_group("cuda:nccl,cpu:gloo" if device.type == "cuda" else "gloo")
            self.owned = True
        if self.world > 1:
            self.world, self.rank = dist.get_world_size(), dist.get_rank()
        self.fsdp = fsdp and self.world > 1
        # Context parallelism: consecutive ranks share a batch slice, each with a sequence part.
        self.cp, self.cp_group = max(1, int(context_parallel or 1)), None
        if self.world % self.cp:
            raise SystemExit(f"--context-parallel {self.cp} does not divide the number of "
                             f"processes {self.world}")
        if self.cp > 1:
            for first in range(0, self.world, self.cp):   # every rank makes every group
                group = dist.new_group(list(range(first, first + self.cp)))
                if first <= self.rank < first + self.cp:
                    self.cp_group = group
        self.cp_rank = self.rank % self.cp
        self.batch_shards, self.batch_rank = self.world // self.cp, self.rank // self.cp

    @property
    def enabled(self) -> bool:
        return self.world > 1

    @property
    def main(self) -> bool:
        return self.rank == 0

    def wrap(self, model, device):
        if not self.enabled:
            return model
        if self.fsdp:
            from torch.distributed.device_mesh import init_device_mesh
            from torch.distributed.fsdp import fully_shard
            # An explicit mesh: the default one follows the accelerator, not --device.
            mesh = init_device_mesh(device.type, (self.world,))
            # A per-token loss is a view (reshaped cross-entropy); it is only reduced, never
            # modified in place, which is what this warning is about.
            warnings.filterwarnings("ignore", message="FSDP2-wrapped module .* returned a view")
            for block in model.model.layers:
                fully_shard(block, mesh=mesh)
            return fully_shard(model, mesh=mesh)
        from torch.nn.parallel import DistributedDataParallel
        return DistributedDataParallel(model, device_ids=[device.index] if device.type == "cuda" else None)

    def sum_(self, t: torch.Tensor) -> torch.Tensor:
        if self.enabled:
            self.dist.all_reduce(t)
        return t

    def barrier(self):
        if self.enabled:
            self.dist.barrier()

    def close(self):
        if self.owned:
            self.dist.destroy_process_group()


class TensorBoard:
    """Scalars to <out_dir>/tensorboard through torch.utils.tensorboard; does nothing (silently)
    when it cannot be imported (the tensorboard package is missing) or is disabled."""

    def __init__(self, out_dir: str, enabled: bool = True, purge_step: Optional[int] = None):
        self.writer = None
        if not enabled:
            return
        try:
            from torch.utils.tensorboard import SummaryWriter
            self.writer = SummaryWriter(os.path.join(out_dir, "tensorboard"), purge_step=purge_step)
        except Exception:
            self.writer = None

    def record(self, record: Dict, archs):
        if self.writer is None:
            return
        step = record["step"]
        for a in archs:
            for k, v in record.get(a, {}).items():
                self.writer.add_scalar(f"{k}/{a}", v, step)
        if "tokens_per_s" in record:
            self.writer.add_scalar("tokens_per_s", record["tokens_per_s"], step)
        self.writer.flush()

    def close(self):
        if self.writer is not None:
            self.writer.close()


def autocast_for(cfg, device: torch.device):
    use_bf16 = cfg["dtype"] == "bf16" or (cfg["dtype"] == "auto" and device.type == "cuda")
    if use_bf16:
        return lambda: torch.autocast(device_type=device.type, dtype=torch.bfloat16)
    return contextlib.nullcontext


def build_model(cfg, arch: str, index: int, device):
    from ..nn import ForgettingTransformerForCausalLM
    torch.manual_seed(cfg["seed"] * 1000 + index)
    model = ForgettingTransformerForCausalLM(cfgmod.model_config(cfg, arch)).to(device)
    if cfg.get("checkpoint_activations"):
        model.set_activation_checkpointing(True)
    return model


def capture_training_step(model, step, warmups: int, device=None):
    """(graph, output) of `step` (a forward + backward returning its loss) captured as a CUDA
    graph after `warmups` runs off the capture (workspaces, caches, autotuning) on a side stream.
    The capture starts from no gradients, so its backward writes them: they live in the graph's
    memory from then on and must not be set to None."""
    side = torch.cuda.Stream(device)
    side.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(side):
        for _ in range(warmups):
            model.zero_grad(set_to_none=True)
            step()
    torch.cuda.current_stream(device).wait_stream(side)
    model.zero_grad(set_to_none=True)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        output = step()
    return graph, output


class GraphedMicroBatch:
    """One model's forward + backward of a micro-batch captured as CUDA graphs and replayed
    (`--cuda-graph`): the host launches one graph instead of a step's hundreds of kernels, so a
    step runs at the GPU's speed however slowly the host launches. Two graphs: the first
    micro-batch of a step writes the gradients (captured from none, so from then on they live in
    the graphs' memory and must not be set to None), the others add to them. The batch is copied
    into static inputs; the loss is the sum of the token losses times 1 / n_valid, the product the
    eager loop's division by a Python number takes, so that both runs agree bit for bit."""

    def __init__(self, model, autocast, micro_batch: int, seq_len: int, device, accumulate: bool):
        self.x = torch.zeros((micro_batch, seq_len), dtype=torch.long, device=device)
        self.y = torch.zeros_like(self.x)
        self.inv_n = torch.ones((), dtype=torch.float32, device=device)

        def step():
            with autocast():
                summed = model(self.x, labels=self.y, reduction="sum")
            loss = summed.float() * self.inv_n
            loss.backward()
            return loss.detach()

        self.first, self.first_loss = capture_training_step(model, step, warmups=2, device=device)
        self.rest = None
        if accumulate:
            self.rest = torch.cuda.CUDAGraph()
            with torch.cuda.graph(self.rest, pool=self.first.pool()):
                self.rest_loss = step()

    def run(self, x, y, n_valid: int, first: bool) -> torch.Tensor:
        """The loss of micro-batch (x, y) (host or device tensors), its gradients written (first)
        or added to the step's."""
        self.x.copy_(x, non_blocking=True)
        self.y.copy_(y, non_blocking=True)
        # ATen divides by a Python number as a product with its float32 reciprocal
        self.inv_n.fill_(float(torch.tensor(1.0, dtype=torch.float32) / n_valid))
        graph, loss = (self.first, self.first_loss) if first else (self.rest, self.rest_loss)
        graph.replay()
        return loss


def _is_dtensor(t) -> bool:
    if not torch.distributed.is_available():
        return False
    from torch.distributed.tensor import DTensor
    return isinstance(t, DTensor)


def full_state_dict(model) -> Dict[str, torch.Tensor]:
    """The model's state dict on the CPU, FSDP2 shards gathered (a collective: every rank calls it)."""
    return {k: (v.full_tensor() if _is_dtensor(v) else v).cpu()
            for k, v in model.state_dict().items()}


def full_optimizer_state(opt) -> Dict:
    """opt.state_dict() with FSDP2 shards gathered: the single-process layout (a collective)."""
    sd = opt.state_dict()
    sd["state"] = {i: {k: (v.full_tensor() if _is_dtensor(v) else v) for k, v in st.items()}
                   for i, st in sorted(sd["state"].items())}
    return sd


def load_optimizer_state(opt, sd: Dict):
    """Loads a full optimizer state; under FSDP2 each rank keeps the shards of its parameters."""
    from torch.distributed.tensor import distribute_tensor
    params = [p for g in opt.param_groups for p in g["params"]]
    sd = dict(sd, state={i: {k: (distribute_tensor(v.to(params[i].device), params[i].device_mesh,
                                                   params[i].placements, src_data_rank=None)
                                 if _is_dtensor(params[i]) and v.shape == params[i].shape else v)
                             for k, v in st.items()}
                         for i, st in sd["state"].items()})
    opt.load_state_dict(sd)


def clip_grad_norm(params, max_norm: float) -> torch.Tensor:
    """clip_grad_norm_ that also takes FSDP2's sharded gradients: the norm is over the full
    gradients, reduced across ranks before scaling."""
    grads = [p.grad for p in params if p.grad is not None]
    norm = torch.nn.utils.get_total_norm(grads)
    if _is_dtensor(norm):
        norm = norm.full_tensor()
    torch.nn.utils.clip_grads_with_norm_(params, max_norm, norm)
    return norm


def count_parameters(model) -> Dict[str, int]:
    total = sum(p.numel() for p in model.parameters())
    emb = sum(p.numel() for n, p in model.named_parameters()
              if n.endswith("embeddings.weight") or n.startswith("lm_head"))
    fgate = sum(p.numel() for n, p in model.named_parameters() if "fgate" in n)
    return {"total": total, "non_embedding": total - emb, "forget_gate": fgate}


def make_optimizer(cfg, arch, model):
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    lr = float(cfgmod.per_model(cfg["lr"], arch))
    return torch.optim.AdamW([{"params": decay, "weight_decay": cfg["weight_decay"]},
                              {"params": no_decay, "weight_decay": 0.0}],
                             lr=lr, betas=tuple(cfg["betas"]))


def lr_at(step: int, peak: float, cfg) -> float:
    """Learning rate of optimizer step ``step`` (0-based): linear warmup from 0, then cosine to
    peak * min_lr_ratio at the last step."""
    warm, total = cfg["warmup_steps"], cfg["steps"]
    if warm > 0 and step < warm:
        return peak * (step + 1) / warm
    progress = (step - warm) / max(1, total - warm)
    floor = peak * cfg["min_lr_ratio"]
    return floor + (peak - floor) * 0.5 * (1 + math.cos(math.pi * min(1.0, progress)))


POINTER = "last"                      # checkpoints/last: the name of the newest step directory
STEP_DIR = re.compile(r"^step_(\d{7,})$")
TMP_PREFIX = ".tmp-"                   # directories being written; never read, removed on start
TRAINER_STATE = "trainer_state.pt"


def checkpoint_dir(out_dir: str) -> str:
    return os.path.join(out_dir, "checkpoints")


def _write_text_atomic(path: str, text: str):
    tmp = f"{path}.tmp.{os.getpid()}"
    with open(tmp, "w") as fh:
        fh.write(text)
        fh.flush()
        os.fsync(fh.fileno())
    os.replace(tmp, path)


def write_checkpoint(out_dir: str, step: int, trainer_state: Dict, weights: Dict) -> str:
    """Writes checkpoints/step_XXXXXXX/ ({arch}/config.json + {arch}/model.safetensors, and
    trainer_state.pt with the rest), then points checkpoints/last at it. The directory is built
    under a temporary name and renamed into place, and the pointer is replaced in one rename, so a
    kill at any moment leaves the previous checkpoint complete and pointed at.
    weights: {arch: (model, full state dict or None)}: the model itself is written when it holds
    full tensors (None), else (FSDP2) an unsharded twin loaded with the gathered ones."""
    from ..nn import ForgettingTransformerForCausalLM
    cdir = checkpoint_dir(out_dir)
    name = f"step_{step:07d}"
    tmp = os.path.join(cdir, f"{TMP_PREFIX}{name}.{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    os.makedirs(tmp)
    for arch, (model, sd) in weights.items():
        if sd is not None:
            model = ForgettingTransformerForCausalLM(model.config)
            model.load_state_dict(sd)
        model.save_pretrained(os.path.join(tmp, arch))
    torch.save(trainer_state, os.path.join(tmp, TRAINER_STATE))
    final = os.path.join(cdir, name)
    if os.path.exists(final):
        # A step taken again after resuming from an older checkpoint (killed before the pointer
        # moved, or the pointer moved back by hand): the pointer names an older directory, not
        # this one, so removing it first cannot lose the checkpoint a resume would use.
        old = os.path.join(cdir, f"{TMP_PREFIX}{name}.old.{os.getpid()}")
        os.replace(final, old)
        shutil.rmtree(old)
    os.replace(tmp, final)
    _write_text_atomic(os.path.join(cdir, POINTER), name + "\n")
    return final


def remove_stale_temporaries(out_dir: str):
    """Half-written checkpoint directories of a killed run (never pointed at, never read)."""
    cdir = checkpoint_dir(out_dir)
    if os.path.isdir(cdir):
        for f in os.listdir(cdir):
            if f.startswith(TMP_PREFIX) or f.startswith(POINTER + ".tmp."):
                p = os.path.join(cdir, f)
                shutil.rmtree(p) if os.path.isdir(p) else os.remove(p)


def _is_checkpoint_dir(path: str) -> bool:
    return os.path.isfile(os.path.join(path, TRAINER_STATE))


def latest_checkpoint(out_dir: str) -> Optional[str]:
    """The checkpoint that checkpoints/last names; without a usable pointer (a kill between the
    first directory's rename and its pointer, or a run of the older format) the newest complete
    step directory, else the older single-file checkpoints/last.pt."""
    cdir = checkpoint_dir(out_dir)
    try:
        with open(os.path.join(cdir, POINTER)) as fh:
            p = os.path.join(cdir, fh.read().strip())
        if _is_checkpoint_dir(p):
            return p
    except OSError:
        pass
    steps = sorted(f for f in (os.listdir(cdir) if os.path.isdir(cdir) else [])
                   if STEP_DIR.match(f) and _is_checkpoint_dir(os.path.join(cdir, f)))
    if steps:
        return os.path.join(cdir, steps[-1])
    p = os.path.join(cdir, "last.pt")
    return p if os.path.exists(p) else None


def load_checkpoint(path: str, map_location="cpu"):
    """A checkpoint as one dict (step, config, train_time, torch_rng, data_state and
    models[arch] = {state_dict, optimizer, model_config}) from a step directory, a run directory
    (its latest checkpoint) or an older single-file .pt checkpoint."""
    from ..nn import load_safetensors
    if os.path.isdir(path) and not _is_checkpoint_dir(path):
        found = latest_checkpoint(path)
        if not found:
            raise SystemExit(f"{path}: no checkpoint in {checkpoint_dir(path)}")
        path = found
    if os.path.isdir(path):
        ckpt = torch.load(os.path.join(path, TRAINER_STATE), map_location=map_location,
                          weights_only=False)
        for arch, entry in ckpt.get("models", {}).items():
            sd = load_safetensors(os.path.join(path, arch, "model.safetensors"))
            entry["state_dict"] = {k: v.to(map_location) for k, v in sd.items()}
    else:
        ckpt = torch.load(path, map_location=map_location, weights_only=False)
    if not isinstance(ckpt, dict) or ckpt.get("format") not in CHECKPOINT_FORMATS:
        raise SystemExit(f"{path}: not a fox checkpoint")
    ckpt["path"] = path
    return ckpt


def models_from_checkpoint(ckpt, device="cpu", archs: Optional[List[str]] = None):
    """{arch: model in eval mode} from a checkpoint."""
    from ..nn import ForgettingTransformerForCausalLM
    out = {}
    for arch, entry in ckpt["models"].items():
        if archs and arch not in archs:
            continue
        model = ForgettingTransformerForCausalLM(cfgmod.model_config(ckpt["config"], arch))
        model.load_state_dict(entry["state_dict"])
        out[arch] = model.to(device).eval()
    return out


class Progress:
    """One progress line: tqdm when installed and on a terminal, else plain prints."""

    def __init__(self, total: int, initial: int, quiet: bool = False):
        self.total, self.quiet, self.bar = total, quiet, None
        if not quiet and sys.stderr.isatty():
            try:
                from tqdm import tqdm
                self.bar = tqdm(total=total, initial=initial, desc="train", dynamic_ncols=True)
            except ImportError:
                pass

    def update(self, step: int, text: str, log: bool):
        if self.quiet:
            return
        if self.bar is not None:
            self.bar.update(step - self.bar.n)
            self.bar.set_postfix_str(text, refresh=False)
        elif log:
            print(f"step {step}/{self.total} {text}", flush=True)

    def write(self, text: str):
        if self.quiet:
            return
        (self.bar.write if self.bar is not None else print)(text)

    def close(self):
        if self.bar is not None:
            self.bar.close()


def _fmt_time(s: float) -> str:
    s = int(max(0, s))
    return f"{s // 3600}:{s % 3600 // 60:02d}:{s % 60:02d}" if s >= 3600 else f"{s // 60}:{s % 60:02d}"


def _truncate_metrics(path: str, step: int):
    """Drop metric records past the resumed step, so a resumed log has no duplicates."""
    if not os.path.exists(path):
        return
    keep = []
    with open(path) as fh:
        for line in fh:
            try:
                if json.loads(line).get("step", 0) <= step:
                    keep.append(line)
            except json.JSONDecodeError:
                pass  # a line cut by a kill
    tmp = path + ".tmp"
    with open(tmp, "w") as fh:
        fh.writelines(keep)
    os.replace(tmp, path)


@torch.no_grad()
def validation_loss(model, corpus, cfg, device, autocast, num_windows: int) -> float:
    ids, labels = corpus.eval_windows(cfg["seq_len"], num_windows)
    was_training = model.training
    model.eval()
    total, count = 0.0, 0
    mb = cfg["micro_batch_size"] or cfg["batch_size"]
    for i in range(0, ids.shape[0], mb):
        x, y = ids[i:i + mb].to(device), labels[i:i + mb].to(device)
        with autocast():
            loss = model(x, labels=y).float()
        mask = y != -100
        total += loss[mask].sum().item()
        count += int(mask.sum())
    model.train(was_training)
    return total / max(1, count)


@contextlib.contextmanager
def _whole_sequences(model, ddp, layout):
    """Context parallelism off for a while (validation reads whole sequences on one rank)."""
    if ddp.cp == 1:
        yield
        return
    from ..distributed import set_context_parallel
    set_context_parallel(model, layout=None)
    try:
        yield
    finally:
        set_context_parallel(model, ddp.cp_group, layout=layout)


def train(cfg, resume: bool = False, corpus: Optional[ByteCorpus] = None, quiet: bool = False,
          stop_at: Optional[int] = None) -> Dict:
    """Runs (or resumes) training; returns a summary dict. ``stop_at`` ends the process-like run
    after that many steps without a final checkpoint (to test kill-and-resume)."""
    if cfg.get("threads"):
        torch.set_num_threads(int(cfg["threads"]))
    out_dir = cfg["out_dir"]
    metrics_path = os.path.join(out_dir, "metrics.jsonl")
    device = resolve_device(cfg)
    autocast = autocast_for(cfg, device)
    if cfg.get("context_parallel_layout", "zigzag") not in ("zigzag", "contiguous"):
        raise SystemExit(f"context_parallel_layout must be zigzag or contiguous, got "
                         f"{cfg['context_parallel_layout']!r}")
    ddp = Distributed(device, fsdp=bool(cfg.get("fsdp")),
                      context_parallel=cfg.get("context_parallel") or 1)
    if cfg.get("fsdp") and not ddp.enabled and not quiet:
        print("--fsdp: one process (no torchrun), nothing to shard", flush=True)
    try:
        return _train(cfg, resume, corpus, quiet or not ddp.main, stop_at, out_dir, metrics_path,
                      device, autocast, ddp)
    finally:
        ddp.close()


def _train(cfg, resume, corpus, quiet, stop_at, out_dir, metrics_path, device, autocast, ddp):
    if cfg.get("cuda_graph"):  # before anything is written
        if device.type != "cuda":
            raise SystemExit("--cuda-graph needs a CUDA device (--device cuda)")
        if ddp.enabled:
            raise SystemExit("--cuda-graph runs in one process (not under torchrun)")
    main = ddp.main
    existing = latest_checkpoint(out_dir)
    ddp.barrier()          # every rank has looked before rank 0 may create anything
    if main:
        os.makedirs(checkpoint_dir(out_dir), exist_ok=True)
        remove_stale_temporaries(out_dir)

    ckpt = None
    if resume:
        path = latest_checkpoint(out_dir)
        if path is None:
            print(f"--resume: no checkpoint in {out_dir}, starting from scratch", file=sys.stderr)
        else:
            ckpt = load_checkpoint(path, map_location="cpu")
            old = ckpt["config"]
            diff = [k for k in STRUCTURAL_KEYS if old.get(k) != cfg.get(k)]
            if diff:
                raise SystemExit(f"--resume: the config differs from the checkpoint's in {diff}")
            # Schedule, intervals etc. may change on resume; take the rest from the new config.
    elif existing is not None:
        raise SystemExit(f"{out_dir} already holds a run: pass --resume to continue it, or "
                         f"choose another --out-dir")

    t_load = time.perf_counter()
    corpus = corpus or make_corpus(cfg)
    t_load = time.perf_counter() - t_load
    max_id = getattr(corpus, "max_id", None)
    if max_id is not None and max_id >= cfg["vocab_size"]:
        if cfg["vocab_size"] != cfgmod.DEFAULTS["vocab_size"]:
            raise SystemExit(f"vocab_size {cfg['vocab_size']} <= the largest token id {max_id}")
        cfg = dict(cfg, vocab_size=max(max_id + 1, cfgmod.DEFAULTS["vocab_size"]))
        if not quiet:
            print(f"vocab_size set to {cfg['vocab_size']} for the token file", flush=True)

    archs = list(cfg["models"])
    models = {a: build_model(cfg, a, i, device) for i, a in enumerate(archs)}
    params = {a: count_parameters(m) for a, m in models.items()}    # before sharding
    if ckpt is not None:      # full tensors: loaded before FSDP2 shards them
        for a in archs:
            models[a].load_state_dict(ckpt["models"][a]["state_dict"])
    # DDP wraps; FSDP2 shards in place (models[a] is then the sharded model) and the optimizers
    # must be made after it, over the sharded parameters.
    wrapped = {a: ddp.wrap(m, device) for a, m in models.items()}
    layout = cfg.get("context_parallel_layout") or "zigzag"
    if ddp.cp > 1:
        from ..distributed import set_context_parallel
        for m in models.values():
            set_context_parallel(m, ddp.cp_group, layout=layout)
    opts = {a: make_optimizer(cfg, a, m) for a, m in models.items()}
    start_step, elapsed_before = 0, 0.0
    if ckpt is not None:
        for a in archs:
            load_optimizer_state(opts[a], ckpt["models"][a]["optimizer"])
        start_step = ckpt["step"]
        elapsed_before = ckpt.get("train_time", 0.0)
        torch.set_rng_state(ckpt["torch_rng"])
        if main:
            _truncate_metrics(metrics_path, start_step)
    if main:
        cfgmod.dump(cfg, os.path.join(out_dir, "config.json"))

    info = {"device": str(device), "data": corpus.summary(), "data_load_s": round(t_load, 2),
            "models": {a: {"params": params[a],
                           "config": cfgmod.describe(cfgmod.model_config(cfg, a))}
                       for a in archs}}
    info["world_size"] = ddp.world
    info["fsdp"] = ddp.fsdp
    info["context_parallel"] = ddp.cp
    if main:
        with open(os.path.join(out_dir, "run_info.json"), "w") as fh:
            json.dump(info, fh, indent=2)
    if not quiet:
        d = info["data"]
        print(f"fox train: preset {cfg['preset']}, device {device}, models {', '.join(archs)}; "
              f"data {d['train_files']} train / {d['val_files']} val files "
              f"({d['train_tokens'] / 1e6:.1f}M / {d['val_tokens'] / 1e6:.1f}M bytes) from "
              f"{d['root']}; out {out_dir}" +
              (f"; {'FSDP2' if ddp.fsdp else 'data parallel'} over {ddp.world} processes"
               if ddp.enabled else "") +
              (f", every sequence split over {ddp.cp} of them ({layout})" if ddp.cp > 1 else ""),
              flush=True)
        for a, m in models.items():
            p = info["models"][a]["params"]
            print(f"  {a}: {p['total'] / 1e6:.2f}M parameters ({p['non_embedding'] / 1e6:.2f}M "
                  f"non-embedding)", flush=True)

    B, T, steps = cfg["batch_size"], cfg["seq_len"], cfg["steps"]
    if B % ddp.batch_shards:
        raise SystemExit(f"batch_size {B} is not a multiple of the {ddp.batch_shards} batch "
                         f"shards (processes / context_parallel)")
    local_B = B // ddp.batch_shards               # this rank's slice of every global batch
    lo = ddp.batch_rank * local_B
    if ddp.cp > 1:
        from ..distributed import shard_sequence
        sequence_part = lambda t: shard_sequence(t, ddp.cp_rank, ddp.cp, layout)  # noqa: E731
    else:
        sequence_part = lambda t: t  # noqa: E731
    mb = min(cfg["micro_batch_size"] or local_B, local_B)
    if local_B % mb:
        raise SystemExit(f"batch_size per process {local_B} is not a multiple of "
                         f"micro_batch_size {mb}")
    for m in models.values():
        m.train()
    graphs = {}  # per model, made at the first step (--cuda-graph)

    def micro_batch_step(a, x, y, n_valid, last_one):
        """The loss of micro-batch (x, y) of model a, its gradients added to the step's."""
        x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
        sync = not ddp.enabled or last_one or not hasattr(wrapped[a], "no_sync")
        with (contextlib.nullcontext() if sync else wrapped[a].no_sync()):
            with autocast():
                # summed in the loss: its gradients come with the forward
                summed = wrapped[a](x, labels=y, reduction="sum")
            loss = summed.float() / n_valid
            # DDP averages gradients over ranks: scale so that they are the sum.
            (loss * ddp.world if ddp.enabled else loss).backward()
        return loss.detach().double()

    def save(step: int, train_time: float):
        # Under FSDP2 every rank takes part in gathering the full state; rank 0 writes it.
        weights = {a: (models[a], full_state_dict(models[a]) if ddp.fsdp else None) for a in archs}
        optims = {a: full_optimizer_state(opts[a]) for a in archs}
        if not main:
            return
        # Everything but the weights, which go to the safetensors files.
        state = {"format": CHECKPOINT_FORMAT, "step": step, "config": cfg,
                 "train_time": train_time, "torch_rng": torch.get_rng_state(),
                 "data_state": {"seed": cfg["seed"], "next_step": step,
                                "val_fraction": cfg["val_fraction"], **corpus.summary()},
                 "models": {a: {"optimizer": optims[a],
                                "model_config": cfgmod.describe(cfgmod.model_config(cfg, a))}
                            for a in archs}}
        write_checkpoint(out_dir, step, state, weights)

    progress = Progress(steps, start_step, quiet)
    metrics = open(metrics_path, "a") if main else open(os.devnull, "w")
    tb = TensorBoard(out_dir, bool(cfg.get("tensorboard", True)) and main, purge_step=start_step + 1)
    t0 = time.perf_counter()
    tokens_this_run = 0
    last = {}
    step = start_step
    try:
        while step < steps:
            ids, labels = corpus.train_batch(cfg["seed"], step, B, T)
            n_valid = int((labels != -100).sum())           # over the global batch
            ids, labels = ids[lo:lo + local_B], labels[lo:lo + local_B]
            ids, labels = sequence_part(ids), sequence_part(labels)
            if device.type == "cuda":
                # Pinned, so that the copies are queued: a pageable copy waits for the GPU.
                ids, labels = ids.pin_memory(), labels.pin_memory()
            record = {"step": step + 1, "tokens": (step + 1) * B * T}
            # The loss and the gradient norm are read back (which waits for the GPU) only at the
            # logged steps: between them the host queues the next steps while the GPU runs.
            log = (step + 1) % cfg["log_interval"] == 0 or step + 1 == steps or step == start_step
            for a in archs:
                model, opt = models[a], opts[a]
                lr = lr_at(step, float(cfgmod.per_model(cfg["lr"], a)), cfg)
                for g in opt.param_groups:
                    g["lr"] = lr
                loss_sum = torch.zeros((), dtype=torch.float64, device=device)
                if cfg.get("cuda_graph"):
                    if a not in graphs:
                        graphs[a] = GraphedMicroBatch(model, autocast, mb, T, device,
                                                      accumulate=local_B > mb)
                    for i in range(0, local_B, mb):
                        loss = graphs[a].run(ids[i:i + mb], labels[i:i + mb], n_valid, i == 0)
                        loss_sum += loss.double()
                else:
                    opt.zero_grad(set_to_none=True)
                    for i in range(0, local_B, mb):
                        loss_sum += micro_batch_step(a, ids[i:i + mb], labels[i:i + mb], n_valid,
                                                     last_one=i + mb >= local_B)
                ddp.sum_(loss_sum)
                gnorm = clip_grad_norm([p for g in opt.param_groups for p in g["params"]],
                                       cfg["grad_clip"])
                opt.step()
                if log:
                    last[a] = float(loss_sum)
                    record[a] = {"loss": round(last[a], 5), "lr": lr,
                                 "grad_norm": round(float(gnorm), 4)}
            step += 1
            tokens_this_run += B * T * len(archs)
            dt = time.perf_counter() - t0
            tps = tokens_this_run / dt
            eta = dt / (step - start_step) * (steps - step)
            record.update({"time": round(elapsed_before + dt, 3), "tokens_per_s": round(tps, 1)})
            if log:
                metrics.write(json.dumps(record) + "\n")
                metrics.flush()
                tb.record(record, archs)
            text = " ".join(f"{a} {last[a]:.3f}" for a in archs)
            progress.update(step, f"loss {text} | {tps:,.0f} tok/s | ETA {_fmt_time(eta)}", log)
            # Under FSDP2 every rank runs the (same) validation forward: it all-gathers.
            if (main or ddp.fsdp) and cfg["eval_interval"] and (step % cfg["eval_interval"] == 0
                                                                or step == steps):
                ev = {"step": step, "eval": True}
                for a in archs:
                    with _whole_sequences(models[a], ddp, layout):
                        val = validation_loss(models[a], corpus, cfg, device, autocast,
                                              cfg["eval_batches"] * B)
                    ev[a] = {"val_loss": round(val, 5)}
                metrics.write(json.dumps(ev) + "\n")
                metrics.flush()
                tb.record(ev, archs)
                progress.write(f"step {step}: val loss " +
                               " ".join(f"{a} {ev[a]['val_loss']:.4f}" for a in archs))
            if stop_at is not None and step >= stop_at:
                return {"stopped_at": step}
            if (main or ddp.fsdp) and (step % cfg["checkpoint_interval"] == 0 or step == steps):
                save(step, elapsed_before + time.perf_counter() - t0)
        ddp.barrier()       # the final checkpoint is on disk before any rank returns
    finally:
        metrics.close()
        tb.close()
        progress.close()
    total_time = time.perf_counter() - t0
    summary = {"out_dir": out_dir, "steps": steps, "resumed_from": start_step,
               "train_time_s": round(total_time, 2), "final_loss": last,
               "checkpoint": latest_checkpoint(out_dir)}
    if not quiet:
        print(f"done: {steps - start_step} steps in {_fmt_time(total_time)} "
              f"({total_time:.1f} s); checkpoint {summary['checkpoint']}", flush=True)
    return summary
