"""A custom training loop on hdp's engine: build, plan, step, log, checkpoint.

Run on CPU (spawns 4 gloo ranks):      python examples/custom_trainer.py --steps 2
With pipeline / tensor parallelism:    python examples/custom_trainer.py --pp 2 --tp 2 --ranks 8
Run under torchrun (any device):       torchrun --nproc-per-node 8 examples/custom_trainer.py --device cuda --tp 2

Every rank runs the same loop on the same global batch; hdp plans which rank computes which
chunk of which sample, and the update equals the single-process update of the whole batch.
"""

from __future__ import annotations

import argparse
import os
import tempfile

import torch
import torch.distributed as dist

from hdp.trainer.cli import positive_int
from hdp.trainer.launch import init_from_env, quiet_third_party_warnings, spawn

quiet_third_party_warnings()  # Megatron's TransformerEngine/Apex fallback notices, torch deprecations

from hdp.trainer.config import EngineConfig, ParallelConfig, PlanningConfig  # noqa: E402
from hdp.trainer.engine import Batch, HdpEngine, LocalTensors  # noqa: E402
from hdp.trainer.model import ModelConfig, OptimConfig  # noqa: E402


def make_batch(step: int, vocab: int, num_samples: int = 12) -> Batch:
    """A synthetic long-tail RL batch: prompt + response, loss on the response, one advantage per sequence."""
    g = torch.Generator().manual_seed(step)
    pareto = 16.0 * (1.0 - torch.rand(num_samples, generator=g)) ** (-1 / 1.2)  # heavy tail, scale 16
    lengths = (pareto.clamp(max=240) + 8).long().tolist()
    tokens = [torch.randint(0, vocab, (n,), generator=g) for n in lengths]
    masks = [torch.cat([torch.zeros(n // 4), torch.ones(n - n // 4)]) for n in lengths]  # response = last 3/4
    advantages = [torch.full((n,), float(torch.randn(1, generator=g))) for n in lengths]
    return Batch(tokens=tokens, loss_mask=masks, extras={"advantages": advantages})


def policy_gradient_loss(local: LocalTensors, logprobs: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """Σ_t w_t · (−A_t · log p_t): hdp's weights already carry the mask and the global normaliser."""
    return -(weights * local.extras["advantages"] * logprobs).sum()


def train(rank: int, world: int, args: argparse.Namespace) -> list[dict]:
    config = EngineConfig(
        model=ModelConfig(num_layers=2, hidden_size=64, num_attention_heads=4, vocab_size=128, max_sequence_length=512),
        optim=OptimConfig(lr=1e-3, clip_grad=1.0),
        planning=PlanningConfig(max_tokens_per_rank=args.tokens_per_rank, policy=args.policy,
                                calibration_path=args.records),  # measured round records for hdp calibrate
        parallel=ParallelConfig(tp=args.tp, pp=args.pp),  # world = TP x PP x domain; hdp plans the domain
        loss_aggregation="token-mean",
        device=args.device,
    )
    engine = HdpEngine.build(config, dist.group.WORLD)  # the whole job; the domain is world / (TP x PP)
    history = []
    for step in range(args.steps):
        batch = make_batch(step, config.model.vocab_size)
        plan = engine.plan(batch)  # pure: the same on every rank; inspect or log it if you like
        metrics = engine.train_step(batch, policy_gradient_loss, plan=plan)
        history.append(metrics)
        if rank == 0:
            print(
                f"step {step}: loss {metrics['loss']:.4f}  grad_norm {metrics['grad_norm']:.3f}  "
                f"rounds {metrics['hdp/rounds']}  cp {metrics['hdp/cp_degree_hist']}  "
                f"{metrics['perf/throughput']:.0f} tok/s/rank  {metrics['perf/step_time'] * 1e3:.0f} ms"
            )

    # log-probs of the last batch without gradients, in the batch's sample order (e.g. for PPO)
    out = engine.forward(batch)
    assert [lp.shape[0] for lp in out.logprobs] == batch.lengths

    # checkpoint, then restore it (every rank calls both)
    ckpt = args.checkpoint_dir or os.path.join(tempfile.gettempdir(), f"hdp-example-{os.getppid()}")
    engine.save_checkpoint(ckpt)
    engine.load_checkpoint(ckpt)
    if rank == 0:
        print(f"checkpoint of step {engine.step} saved to and restored from {ckpt}")
    engine.close()
    return history


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=positive_int, default=3, help="training steps (at least 1)")
    parser.add_argument("--ranks", type=positive_int, default=4, help="local ranks to spawn (ignored under torchrun)")
    parser.add_argument("--policy", default="hdp", choices=["hdp", "static-cp"])
    parser.add_argument("--tokens-per-rank", type=positive_int, default=128)
    parser.add_argument("--tp", type=positive_int, default=1, help="tensor-parallel size (sequence parallel on)")
    parser.add_argument("--pp", type=positive_int, default=1, help="pipeline stages (each round one micro-batch)")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--checkpoint-dir", default=None)
    parser.add_argument("--records", default=None, help="append calibration records here (hdp calibrate --records)")
    args = parser.parse_args()
    if init_from_env(args.device):  # launched by torchrun
        train(dist.get_rank(), dist.get_world_size(), args)
        dist.destroy_process_group()
    else:
        spawn(train, args.ranks, args)


if __name__ == "__main__":
    main()
