"""verl's trainer-side batches (for the worker tests and the verl fault bench): padded rollout tensors -> ``left_right_2_no_padding``.

Built exactly as ``RayPPOTrainer._compute_ref_log_prob`` / ``_compute_old_log_prob`` /
``_update_actor`` do (verl/trainer/ppo/ray_trainer.py), from (prompt, response) token lists.
"""

from __future__ import annotations

from typing import Any, Sequence

import torch

__all__ = ["whole_batch_loss", "padded_batch", "ref_batch", "old_logp_batch", "update_batch", "values_batch", "critic_update_batch",
           "random_samples"]


def random_samples(lengths: Sequence[tuple[int, int]], vocab: int, seed: int) -> list[tuple[list[int], list[int]]]:
    """(prompt ids, response ids) with ids in [3, vocab) (no pad / special tokens)."""
    g = torch.Generator().manual_seed(seed)
    return [
        (torch.randint(3, vocab, (p,), generator=g).tolist(), torch.randint(3, vocab, (r,), generator=g).tolist())
        for p, r in lengths
    ]


def padded_batch(samples: Sequence[tuple[list[int], list[int]]], pad_id: int, *, seed: int = 0) -> dict[str, torch.Tensor]:
    """Left-padded prompts, right-padded responses, attention/response masks and position ids (verl's layout)."""
    g = torch.Generator().manual_seed(seed)
    bs = len(samples)
    pmax = max(len(p) for p, _ in samples)
    rmax = max(len(r) for _, r in samples)
    prompts = torch.full((bs, pmax), pad_id, dtype=torch.int64)
    responses = torch.full((bs, rmax), pad_id, dtype=torch.int64)
    attn = torch.zeros((bs, pmax + rmax), dtype=torch.int64)
    resp_mask = torch.zeros((bs, rmax), dtype=torch.int64)
    for i, (p, r) in enumerate(samples):
        prompts[i, pmax - len(p) :] = torch.tensor(p)
        responses[i, : len(r)] = torch.tensor(r)
        attn[i, pmax - len(p) : pmax + len(r)] = 1
        m = (torch.rand(len(r), generator=g) > 0.15).to(torch.int64)  # tool-output tokens are masked out
        m[0] = 1
        resp_mask[i, : len(r)] = m
    return {
        "prompts": prompts,
        "responses": responses,
        "input_ids": torch.cat([prompts, responses], dim=1),
        "attention_mask": attn,
        "position_ids": (attn.cumsum(-1) - 1).clamp_min(0),
        "response_mask": resp_mask,
    }


def _td(tensors: dict[str, torch.Tensor], **non_tensor: Any) -> Any:
    from verl.utils import tensordict_utils as tu
    from verl.workers.utils.padding import left_right_2_no_padding

    from hdp.integrations.verl.scaffolding import padding

    padding.install()  # verl 0.9.0 on CPU: unpads through flash-attn only
    td = tu.get_tensordict(tensor_dict=dict(tensors), non_tensor_dict={"temperature": non_tensor.pop("temperature", 1.0)})
    td = left_right_2_no_padding(td)
    tu.assign_non_tensor(td, **non_tensor)
    return td


def ref_batch(padded: dict[str, torch.Tensor]) -> Any:
    """``_compute_ref_log_prob``'s TensorDict."""
    return _td(padded, calculate_entropy=False, compute_loss=False)


def old_logp_batch(padded: dict[str, torch.Tensor], temperature: float = 1.0) -> Any:
    """``_compute_old_log_prob``'s TensorDict (entropy requested)."""
    return _td(padded, temperature=temperature, calculate_entropy=True, calculate_sum_pi_squared=False, compute_loss=False)


def update_batch(padded: dict[str, torch.Tensor], extra: dict[str, torch.Tensor], *, mini_batch_size: int,
                 temperature: float = 1.0, calculate_entropy: bool = False, seed: int = 0, epochs: int = 1) -> Any:
    """``_update_actor``'s TensorDict: ``extra`` holds padded ``old_log_probs``, ``advantages``, ``ref_log_prob``;
    ``epochs`` × (batch / ``mini_batch_size``) mini-batches (verl's ``ppo_epochs``)."""
    return _td(
        {**padded, **extra},
        temperature=temperature,
        calculate_entropy=calculate_entropy,
        distillation_use_topk=False,
        distillation_only=False,
        global_batch_size=mini_batch_size,
        mini_batch_size=mini_batch_size,
        epochs=epochs,
        seed=seed,
        dataloader_kwargs={"shuffle": False},
        compute_loss=True,
    )


def values_batch(padded: dict[str, torch.Tensor]) -> Any:
    """``_compute_values``'s TensorDict (the critic's forward)."""
    return _td(padded, compute_loss=False)


def critic_update_batch(padded: dict[str, torch.Tensor], extra: dict[str, torch.Tensor], *, mini_batch_size: int,
                        seed: int = 0, epochs: int = 1) -> Any:
    """``_update_critic``'s TensorDict: ``extra`` holds padded ``values`` (the old values) and ``returns``."""
    return _td({**padded, **extra}, global_batch_size=mini_batch_size, mini_batch_size=mini_batch_size,
               epochs=epochs, seed=seed, dataloader_kwargs={"shuffle": False})


def whole_batch_loss(loss_fn: Any, data: Any, **per_sample: Sequence[torch.Tensor]) -> tuple[torch.Tensor, Any]:
    """verl's loss function ``loss_fn`` (its config bound) on one process's whole mini-batch ``data`` (the tests'
    reference): ``dp_size`` 1, ``batch_num_tokens`` of the loss mask, and each ``per_sample`` output (``log_probs``,
    ``entropy``, ``values``: one [L_i] tensor per sample) as verl's jagged nested tensor."""
    from verl.utils import tensordict_utils as tu

    mask = data["loss_mask"]
    tu.assign_non_tensor(data, dp_size=1, batch_num_tokens=int(mask.values().sum() if mask.is_nested else mask.sum()))
    out = {k: torch.nested.as_nested_tensor(list(v), layout=torch.jagged) for k, v in per_sample.items()}
    return loss_fn(model_output=out, data=data)
