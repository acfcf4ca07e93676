"""One rank of a torch training on a gloo process group (run by
tests/test_distributed_torch.py).

argv: rank world port url mode steps [kill_at]; mode: ddp, fsdp2 or single (world 1,
the whole global batch in one process). Same code on every rank, same store URL, no
rank checks. Writes ``<url>.clip<rank>.json``: ``clip_grad_norm_``'s total norm per step
(max norm 0.05: every step is clipped, so the recorded grad must be the pre-clip one).
"""

import json
import os
import sys

import torch
import torch.distributed as dist
from torch import nn

import traintape
import traintape.torch as tt

rank, world, port, url, mode, steps = sys.argv[1:7]
rank, world, steps = int(rank), int(world), int(steps)
kill_at = int(sys.argv[7]) if len(sys.argv) > 7 else -1
torch.manual_seed(0)
torch.use_deterministic_algorithms(True)
model = nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 8))
if mode != "single":
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world
    )
if mode == "ddp":
    model = nn.parallel.DistributedDataParallel(model)
elif mode == "fsdp1":
    from torch.distributed.fsdp import FullyShardedDataParallel

    model = FullyShardedDataParallel(model, use_orig_params=True, device_id=torch.device("cpu"))
elif mode == "fsdp2":
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (world,))
    fully_shard(model[0], mesh=mesh)
    fully_shard(model[2], mesh=mesh)
    fully_shard(model, mesh=mesh)
    from torch.distributed.tensor import DTensor

    assert all(isinstance(p, DTensor) for p in model.parameters())
    assert model[0].weight.to_local().shape[0] == 32 // world  # each rank holds a shard
opt = torch.optim.Adam(model.parameters(), lr=1e-2)
kinds = ("param", "grad", "update", "activation", "opt_state")
policy = traintape.CapturePolicy(full_every=2, kinds=kinds, snapshot_kinds=kinds)
rec = traintape.Recorder(url, policy, flush_every_steps=1)
assert rec.group.count == world and rec.group.index == rank, rec.group
tt.watch(model, rec, opt)
norms = []
per = 24 // world
for t in range(steps):
    g = torch.Generator().manual_seed(t + 1)
    x = torch.randn(24, 16, generator=g)
    y = torch.sin(x[:, :8])
    xs, ys = x[rank * per : (rank + 1) * per], y[rank * per : (rank + 1) * per]
    loss = torch.mean((model(xs) - ys) ** 2)
    opt.zero_grad()
    loss.backward()
    norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), 0.05)))
    opt.step()
    logged = loss.detach().clone()
    if world > 1:  # the global batch's loss (each rank's is its part's)
        dist.all_reduce(logged)
        logged /= world
    rec.log(t, loss=float(logged))
    if t == kill_at:
        rec.flush()
        if rank == world - 1:
            os._exit(9)  # this rank dies mid-run
        os._exit(0)  # the survivors: the next collective could not complete
rec.close()
with open(f"{url}.clip{rank}.json", "w") as f:
    json.dump(norms, f)
print(f"rank {rank}: done, wrote {rec._writer.rows_committed} rows", flush=True)
if world > 1:
    dist.destroy_process_group()
