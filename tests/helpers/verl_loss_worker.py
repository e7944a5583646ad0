"""Definitions more than one test module needs (a test module never imports another), moved out of
test_verl_loss_worker.py; used by tests/slow/verl/test_verl_loss_worker.py,
tests/unit/verl/test_verl_fused_logprobs.py."""

from __future__ import annotations


def _hf(model_path: str, samples, temperature: float = 1.0):
    """fp32 HF per sample: input-aligned log-probs and entropies [L_i] (a graph to the model's weights) and Σp² [L_i]."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32)
    logps, ents, sq = [], [], []
    for p, r in samples:
        ids = torch.tensor(p + r)[None]
        full = torch.log_softmax(model(input_ids=ids).logits[0].float() / temperature, dim=-1)  # [L, V]
        lp = full[:-1].gather(-1, ids[0, 1:, None])[:, 0]
        logps.append(torch.cat([lp, lp.new_zeros(1)]))
        ents.append(-(full.exp() * full).sum(-1))
        sq.append(full.exp().pow(2).sum(-1).detach())
    return model, logps, ents, sq
