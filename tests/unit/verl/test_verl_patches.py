"""The verl integration's patch surface and supported verl versions.

* The patches in place are the table (``hdp.integrations.verl.patches.PATCHES``, shown in docs/verl.md): a fresh
  process that imports verl and every verl module the plugin hooks (as main_ppo's driver and task runner do) holds
  exactly the table's ``import`` rows, found by reading the modules themselves, and no hdp code anywhere else in an
  installed library's namespace.  (The ``engine`` and ``call`` rows: tests/distributed/verl/test_verl_worker_path.py
  tests/slow/verl/test_verl_worker_path_slow.py, in verl's
  worker.)  A patch made without the helper is reported as undocumented; the helper refuses a name the table lacks.
* An unsupported verl is refused at import with a message naming the installed version, the supported range and
  the fix (the version reading monkeypatched, not the installed package).
"""

from __future__ import annotations

import logging
import re
import sys
from pathlib import Path

import pytest

pytest.importorskip("verl")

from hdp.integrations.verl import patches  # noqa: E402
from hdp.integrations.verl.patches import PATCHES

DOCS = Path(__file__).resolve().parents[3] / "docs" / "verl.md"
"""The verl modules the plugin patches right after their import (plugin._HOOKS, less the engine registry)."""


def _docs_table() -> dict[str, str]:
    text = DOCS.read_text()
    body = text.split("<!-- patches:begin -->", 1)[1].split("<!-- patches:end -->", 1)[0]
    rows = [line for line in body.splitlines() if line.startswith("| `")]
    return {m.group(1): m.group(2) for m in (re.match(r"\| `([^`]+)` \| (\w+) \|", r) for r in rows) if m}


def test_the_docs_table_is_the_patch_table():
    assert _docs_table() == {p.name: p.scope.value for p in PATCHES}
    assert len({p.name for p in PATCHES}) == len(PATCHES)
    assert all(p.why and p.removed_by for p in PATCHES)


def test_every_patch_in_this_process_is_in_the_table():
    """In the test process (other tests built engines, ran losses): whatever is in place is a row of the table."""
    found = patches.installed()
    undocumented = found.pop("undocumented", [])
    assert undocumented == [], undocumented
    found.pop("import hook", None)
    assert set(found) <= {p.name for p in PATCHES}
    assert patches.used() <= {p.name for p in PATCHES}


def test_a_patch_made_without_the_helper_is_undocumented(monkeypatch):
    """hdp code put into verl's namespace by hand (no ``patches.wrap``) is found and reported."""
    import verl.utils.tensordict_utils as tu

    from hdp.integrations.verl import minibatches

    monkeypatch.setattr(tu, "make_iterator_by_hand", minibatches.stock_dp_size, raising=False)
    assert "verl.utils.tensordict_utils.make_iterator_by_hand" in patches.installed().get("undocumented", [])
    with pytest.raises(AssertionError, match=r"verl\.utils\.tensordict_utils\.nope: not in patches\.PATCHES"):
        patches.wrap("verl.utils.tensordict_utils.nope", tu, "make_iterator", lambda f: f)


def test_a_call_scoped_patch_is_restored():
    from verl.trainer.ppo import core_algos

    before = core_algos.POLICY_LOSS_REGISTRY
    with patches.policy_losses_wrapped(lambda name, fn: fn):
        assert core_algos.POLICY_LOSS_REGISTRY is not before
        assert "verl.trainer.ppo.core_algos.POLICY_LOSS_REGISTRY" in patches.installed()
    assert core_algos.POLICY_LOSS_REGISTRY is before
    assert "verl.trainer.ppo.core_algos.POLICY_LOSS_REGISTRY" not in patches.installed()


# ---- supported verl versions -------------------------------------------------------------------------------------

REFUSAL = (r"hdp's verl integration supports verl 0\.9\.0 to 0\.9\.1 \(0\.9\.0, 0\.9\.1\); this environment has verl "
           r"0\.10\.0, .*Fix: pip install 'verl>=0\.9\.0,<0\.9\.2'.*VERL_USE_EXTERNAL_PLUGINS=none")


@pytest.mark.parametrize(("version", "ok"), [("0.9.0", True), ("0.9.1", True), ("0.9.1.dev0", True),
                                             ("0.9.1+local", True), ("0.9.2", False), ("0.8.5", False),
                                             ("0.10.0", False), ("1.0", False), ("not-a-version", False)])
def test_supported_versions(version, ok):
    import hdp.integrations.verl as V

    why = V.unsupported_verl(version)
    assert (why is None) == ok, why
    if not ok:
        assert f"this environment has verl {version}," in why


def test_an_unsupported_verl_is_refused_naming_version_range_and_fix(monkeypatch, caplog):
    """The plugin logs an ERROR and installs no patch; the engine door and hdp's verl modules raise ImportError."""
    import hdp.integrations.verl as V
    from hdp.integrations.verl import plugin

    monkeypatch.setattr(V, "verl_version", lambda: "0.10.0")

    def no_patch(*args, **kwargs):
        raise AssertionError(f"a patch was installed on an unsupported verl: {args[:1]}")

    monkeypatch.setattr(patches, "wrap", no_patch)
    with caplog.at_level(logging.ERROR, logger=plugin.__name__):
        assert plugin.register() is False
    assert re.search(REFUSAL, caplog.text), caplog.text
    with pytest.raises(ImportError, match=REFUSAL):
        V.check_verl_version()
    engine = plugin._lazy_engine(object)  # the class registered as backend "hdp" (on verl's BaseEngine)
    with pytest.raises(ImportError, match=REFUSAL):
        engine(model_config=None, engine_config=None, optimizer_config=None, checkpoint_config=None)
    with pytest.raises(ImportError, match=REFUSAL):
        engine.resolve()
    monkeypatch.delitem(sys.modules, "hdp.integrations.verl.compat", raising=False)  # hdp's engine, configs import it
    with pytest.raises(ImportError, match=REFUSAL):
        import hdp.integrations.verl.compat  # noqa: F401


def test_the_cpu_padding_helpers_for_verl_090_are_verl_091s():
    """verl 0.9.0 unpads its batches through flash-attn only; the CPU scaffolding gives it verl 0.9.1's torch
    fallbacks (``scaffolding.padding``): equal to 0.9.1's own (where installed) and exact round trips."""
    import torch
    from verl.utils import attention_utils

    from hdp.integrations.verl.scaffolding import padding

    g = torch.Generator().manual_seed(0)
    mask = (torch.rand(3, 7, generator=g) > 0.3).long()  # [B, L]
    mask[:, 0] = 1
    x = torch.randn(3, 7, 4, generator=g)  # [B, L, H]
    got = padding.unpad_input(x, mask)
    if hasattr(attention_utils, "_fallback_unpad_input"):  # verl 0.9.1's own fallback
        want = attention_utils._fallback_unpad_input(x, mask)
        assert all(torch.equal(a, b) if torch.is_tensor(a) else a == b for a, b in zip(got, want))
        assert padding.install() is False  # nothing to do on 0.9.1
    rows, idx, cu, longest, used = got
    assert torch.equal(padding.pad_input(rows, idx, 3, 7), x * mask[..., None])
    assert cu.tolist() == [0, *mask.sum(-1).cumsum(0).tolist()] and longest == int(mask.sum(-1).max())
    assert torch.equal(used, mask.sum(-1).int())


def test_a_value_model_by_vanilla_mbridge_needs_verl_091():
    """What the critic's engine checks when it is constructed (the driver's check: tests/unit/verl/test_verl_config.py tests/distributed/verl/test_verl_config_dist.py tests/slow/verl/test_verl_config_slow.py)."""
    from hdp.integrations.verl.checks import check_value_model_building

    with pytest.raises(ValueError, match=r"critic\.megatron\.vanilla_mbridge=True with verl 0\.9\.0: .*"
                                         r"pip install 'verl==0\.9\.1'"):
        check_value_model_building("0.9.0", True)
    check_value_model_building("0.9.1", True)
    check_value_model_building("0.9.0", False)  # Megatron-Bridge sets it on its provider
