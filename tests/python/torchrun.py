"""Launches `forgetting_transformer train` on 2 local processes through torchrun (the data-parallel
and FSDP tests)."""
import os
import socket
import subprocess
import sys


def torchrun_train(args, timeout=180, nproc=2):
    """Runs `python -m torch.distributed.run --nproc_per_node <nproc> -m forgetting_transformer
    train *args` on a free local port, one OpenMP thread per process; asserts it succeeded and returns
    the completed process (stdout, stderr)."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path), OMP_NUM_THREADS="1")
    env.pop("WORLD_SIZE", None)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    r = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(nproc),
                        "--master_addr", "127.0.0.1", "--master_port", str(port),
                        "-m", "forgetting_transformer", "train", *args],
                       capture_output=True, text=True, env=env, timeout=timeout)
    assert r.returncode == 0, r.stdout[-2000:] + "\n" + r.stderr[-3000:]
    return r
