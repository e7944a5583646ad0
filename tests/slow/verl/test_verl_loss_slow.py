"""The slow tier (over ~20 s) of the tests tests/distributed/verl/test_verl_loss_dist.py describes: its docstring says what they check and how."""

from __future__ import annotations

import pytest

pytest.importorskip("verl")

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from helpers.dist_helper import run_distributed  # noqa: E402

V = 11
MODES = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum")


def _batch(seed: int):
    """verl's no-padding update batch: nested input_ids/prompts/responses/response_mask/old_log_probs/advantages."""
    from tensordict import TensorDict

    from verl.utils import tensordict_utils as tu

    g = torch.Generator().manual_seed(seed)
    prompts, responses, masks, old, adv = [], [], [], [], []
    for i in range(7):
        p = int(torch.randint(2, 6, (1,), generator=g))
        r = [1, 3, 20, 9, 14, 2, 25][i]
        prompts.append(torch.randint(0, V, (p,), generator=g))
        responses.append(torch.randint(0, V, (r,), generator=g))
        m = (torch.rand(r, generator=g) > 0.2).to(torch.int64)
        m[0] = 1
        masks.append(m)
        old.append(-torch.rand(r, generator=g, dtype=torch.float64) * 3)
        adv.append(torch.randn(r, generator=g, dtype=torch.float64))
    nest = lambda xs: torch.nested.as_nested_tensor(xs, layout=torch.jagged)  # noqa: E731
    ids = [torch.cat([p, r]) for p, r in zip(prompts, responses)]
    td = TensorDict(
        {
            "input_ids": nest(ids),
            "prompts": nest(prompts),
            "responses": nest(responses),
            "response_mask": nest(masks),
            "old_log_probs": nest(old),
            "advantages": nest(adv),
        },
        batch_size=len(ids),
    )
    tu.assign_non_tensor(td, global_batch_size=len(ids))
    return td, ids, masks


def _config(mode: str):
    from verl.workers.config import ActorConfig

    return ActorConfig(strategy="hdp", rollout_n=1, ppo_micro_batch_size_per_gpu=1, loss_agg_mode=mode)


def _logp(table: torch.Tensor, tokens: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return torch.log_softmax(table[tokens], dim=-1).gather(-1, targets[:, None])[:, 0]  # [T]


def _reference(mode: str, seed: int):
    from verl.utils import tensordict_utils as tu
    from verl.workers.utils.losses import ppo_loss

    data, ids, masks = _batch(seed)
    table = torch.randn(V, V, generator=torch.Generator().manual_seed(99), dtype=torch.float64).requires_grad_()
    lps = [torch.cat([_logp(table, x[:-1], x[1:]), table.new_zeros(1)]) for x in ids]  # input-aligned
    tu.assign_non_tensor(data, dp_size=1, batch_num_tokens=int(sum(int(m.sum()) for m in masks)))
    loss, _ = ppo_loss(_config(mode), {"log_probs": torch.nested.as_nested_tensor(lps, layout=torch.jagged)}, data)
    loss.backward()
    return float(loss), table.grad.clone()


def _worker(rank: int, world: int, seed: int) -> None:
    from hdp.dispatch import group_to_leader, leader_to_group, local_meta, pack
    from hdp.groups import DomainGroups
    from hdp.packing import PlannerConfig, plan
    from hdp.core.rounds import next_token_targets
    from verl.utils import tensordict_utils as tu
    from verl.workers.utils.losses import ppo_loss

    group = dist.group.WORLD
    domain = DomainGroups.build(group)
    for mode in MODES:
        ref_loss, ref_grad = _reference(mode, seed)
        data, ids, masks = _batch(seed)
        targets = next_token_targets(ids, 0)
        table = torch.randn(V, V, generator=torch.Generator().manual_seed(99), dtype=torch.float64).requires_grad_()
        p = plan([len(x) for x in ids], PlannerConfig(num_ranks=world, max_tokens_per_rank=16))
        assert max(p.group_size) > 1, "the batch must split some sample for this test to mean anything"
        tu.assign_non_tensor(data, dp_size=1, batch_num_tokens=int(sum(int(m.sum()) for m in masks)))
        led = 0.0
        for r in range(p.num_rounds):
            meta = local_meta(p, rank, r)
            if meta.num_tokens == 0:
                continue  # a rank without tokens takes no part in the exchange
            logp = _logp(table, pack(meta, ids), pack(meta, targets))  # [T]
            full = group_to_leader(meta, logp, domain)  # [ΣL_i] on the group's first rank, None elsewhere
            grad = None
            if full is not None:
                leaf = full.detach().requires_grad_()
                # a sample's last position predicts nothing; verl never reads it
                pieces = [torch.cat([f[:-1], f.new_zeros(1)]) for f in leaf.split(list(meta.group_lengths))]
                sub = tu.index_select_tensor_dict(data, list(meta.samples))
                out = {"log_probs": torch.nested.as_nested_tensor(pieces, layout=torch.jagged)}
                loss, _ = ppo_loss(_config(mode), out, sub)
                (grad,) = torch.autograd.grad(loss, leaf)
                led += float(loss)
            mine = leader_to_group(meta, grad, logp, domain)  # [T]: the loss's gradient at this rank's rows
            assert (mine is grad) == (meta.k == 1)
            (logp * mine).sum().backward()
        grad = table.grad.clone()
        dist.all_reduce(grad, group=group)  # the domain sum of gradients (the engine undoes DDP's 1/N)
        total = torch.tensor([led], dtype=torch.float64)
        dist.all_reduce(total, group=group)
        torch.testing.assert_close(grad, ref_grad, rtol=1e-10, atol=1e-10, msg=f"{mode}: gradient")
        assert abs(float(total) - ref_loss) < 1e-10, (mode, float(total), ref_loss)


@pytest.mark.parametrize("world", [2, 4])
def test_verl_ppo_loss_exact_under_hdp_plans(world: int):
    run_distributed(_worker, world, 5, timeout=240)
