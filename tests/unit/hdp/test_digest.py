"""batch_digest: equal batches agree, any change of a token, mask value, extra, dtype or name differs."""

from __future__ import annotations

import torch

from hdp.digest import batch_digest


def _batch():
    g = torch.Generator().manual_seed(0)
    tokens = [torch.randint(0, 100, (n,), generator=g) for n in (5, 9, 1)]
    mask = [torch.ones(n, dtype=torch.bool) for n in (5, 9, 1)]
    extras = {"adv": [torch.randn(n, generator=g) for n in (5, 9, 1)],
              "old": [torch.randn(n, generator=g).bfloat16() for n in (5, 9, 1)]}
    return tokens, mask, extras


def test_same_batch_same_digest_and_every_change_differs():
    tokens, mask, extras = _batch()
    ref = batch_digest(tokens, mask, extras)
    assert ref == batch_digest([t.clone() for t in tokens], [m.clone() for m in mask],
                               {k: [x.clone() for x in v] for k, v in reversed(list(extras.items()))})
    assert -(1 << 63) <= ref < (1 << 63)
    changed = []
    t2 = [t.clone() for t in tokens]
    t2[1][3] += 1
    changed.append(batch_digest(t2, mask, extras))
    m2 = [m.clone() for m in mask]
    m2[0][0] = False
    changed.append(batch_digest(tokens, m2, extras))
    changed.append(batch_digest(tokens, None, extras))
    e2 = {k: [x.clone() for x in v] for k, v in extras.items()}
    e2["old"][2] = e2["old"][2] + 1
    changed.append(batch_digest(tokens, mask, e2))
    changed.append(batch_digest(tokens, mask, {"adv2": extras["adv"], "old": extras["old"]}))
    changed.append(batch_digest([t.to(torch.int32) for t in tokens], mask, extras))
    changed.append(batch_digest(tokens[:2], mask[:2], {k: v[:2] for k, v in extras.items()}))
    assert all(c != ref for c in changed) and len(set(changed)) == len(changed)
