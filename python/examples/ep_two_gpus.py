"""One FP8 MoE layer with its experts split over 2 GPUs, one process each (docs/API.md,
"Expert parallelism from Python"). From the repository root:

    torchrun --nproc-per-node 2 python/examples/ep_two_gpus.py
    python python/examples/ep_two_gpus.py        # spawns its 2 processes itself

Each rank joins a NCCL process group, makes its moefuse.EpGroup from it, and runs the layer on
its own tokens three ways: in one call, in three (dispatch, its experts, combine), and as a
torch custom operator; each is checked against the whole layer on one GPU.
"""

import os

import torch
import torch.distributed as dist

import moefuse
import moefuse.torch_ops  # torch.ops.moefuse.*, the ep_* operators among them

E, K, I, k, M = 8, 256, 128, 2, 32  # experts, hidden, intermediate, top-k, tokens per rank


def fp8_experts(device):
    """All E experts as a checkpoint stores them, the same on every rank (one seed)."""
    g = torch.Generator().manual_seed(0)
    w1 = torch.randn(E, 2 * I, K, generator=g) * 0.5  # gate | up rows
    w2 = torch.randn(E, K, I, generator=g) * 0.5
    w1_scales = torch.rand(E, 2 * I // 128, K // 128, generator=g) * 3e-3 + 1e-3
    w2_scales = torch.rand(E, K // 128, I // 128, generator=g) * 3e-3 + 1e-3
    return [t.to(device) for t in (w1.to(torch.float8_e4m3fn), w1_scales,
                                   w2.to(torch.float8_e4m3fn), w2_scales)]


def run(rank, world):
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", rank)))
    torch.cuda.set_device(device)
    dist.init_process_group("nccl", rank=rank, world_size=world)
    # rank 0 makes NCCL's unique id; it reaches every rank through the process group
    group = moefuse.EpGroup.from_process_group(device, num_experts=E)
    w1, w1_scales, w2, w2_scales = fp8_experts(device)
    mine = group.local_expert_ids()  # [0, 1, 2, 3] on rank 0, [4, 5, 6, 7] on rank 1
    experts = (w1[mine], w1_scales[mine], w2[mine], w2_scales[mine])

    g = torch.Generator(device=device).manual_seed(1 + rank)  # each rank has its own tokens
    x = torch.randn(M, K, generator=g, device=device).to(torch.bfloat16)
    ids, weights = moefuse.topk_softmax(torch.randn(M, E, generator=g, device=device), k)

    # 1. the layer in one call: x quantized, rows to the experts' ranks, the sum back
    out = group.moe_forward_fp8(x, *experts, ids, weights)

    # 2. the same in three: dispatch (FP8 rows, half the bytes of bf16), this rank's experts
    #    in the masked layout [E_local, Tmax, K], combine (the weighted sum on x's rank)
    with group.dispatch(x, ids, weights, tmax=world * M, quantize=True) as h:
        y = moefuse.moe_masked_fp8(h.recv_x, h.recv_counts, *experts, x_scales=h.recv_scales)
        out_steps = group.combine(h, y)

    # 3. as a custom operator (torch.compile traces it), the group named by its id
    out_op = torch.ops.moefuse.ep_moe_forward_fp8(group.id, x, *experts, ids, weights)

    want = moefuse.moe_forward_fp8(x, w1, w1_scales, w2, w2_scales, ids, weights)  # one GPU
    for name, got in (("moe_forward_fp8", out), ("dispatch, experts, combine", out_steps),
                      ("torch.ops.moefuse.ep_moe_forward_fp8", out_op)):
        error = ((got.float() - want.float()).norm() / want.float().norm()).item()
        print(f"rank {rank}: {name}: relative error {error:.1e} against one GPU")
        assert error < 2e-2, name
    group.close()  # before its context, which the group made and now frees
    dist.destroy_process_group()


if __name__ == "__main__":
    if "RANK" in os.environ:  # torchrun set the rank and the rendezvous
        run(int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]))
    else:
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", "29512")
        torch.multiprocessing.spawn(run, args=(2,), nprocs=2)
