"""verl integration: ``actor_rollout_ref.actor.strategy=hdp`` resolves actor and ref to the hdp engine.

Runs only where verl is installed (``pip install verl==0.9.1`` without its ``[megatron]`` extra);
the main test run skips this module.
"""

from __future__ import annotations

import dataclasses
import warnings

import pytest

from helpers.verl_config import BASE, _compose, _engine_cls, _ref_config, _validate

pytest.importorskip("verl")
warnings.filterwarnings("ignore", message=".*engine is not available.*")

import torch  # noqa: E402

from verl.trainer.ppo.utils import need_reference_policy
from verl.utils.config import omega_conf_to_dataclass

from hdp.integrations.verl import config_dir, verl_version  # noqa: E402
from hdp.integrations.verl import plugin  # noqa: E402  (registers the engine, as `import verl` would)
from hdp.integrations.verl.config import (  # noqa: E402
    HdpActorConfig,
    HdpEngineConfig,
    HdpOptions,
    to_hdp_engine_config,
    to_mcore_optimizer_config,
)
from hdp.integrations.verl.batch import metric_shapes  # noqa: E402
from hdp.integrations.verl.engine import HdpMegatronEngine  # noqa: E402


def test_strategy_hdp_on_stock_ppo_trainer_selects_hdp_for_actor_and_ref():
    cfg = _compose("ppo_trainer", BASE + ["actor_rollout_ref.actor.strategy=hdp", "actor_rollout_ref.actor.use_dynamic_bsz=true"])
    assert need_reference_policy(cfg)
    actor = omega_conf_to_dataclass(cfg.actor_rollout_ref.actor)
    ref = _ref_config(cfg)
    assert actor.engine.strategy == "hdp" and ref.engine.strategy == "hdp"
    assert _engine_cls(actor.engine) is HdpMegatronEngine
    assert _engine_cls(ref.engine) is HdpMegatronEngine
    _validate(cfg)
    # what the engine makes of verl's FSDP-shaped configs
    eng = to_hdp_engine_config(actor.engine)
    assert isinstance(eng, HdpEngineConfig) and eng.strategy == "hdp"
    assert eng.tensor_model_parallel_size == 1 and eng.context_parallel_size == 1
    assert eng.hdp == HdpOptions()
    assert to_hdp_engine_config(ref.engine).forward_only
    optim = to_mcore_optimizer_config(actor.optim)
    assert type(optim).__name__ == "McoreOptimizerConfig" and optim.lr == actor.optim.lr


def test_model_engine_hdp_gives_hdp_configs_with_options():
    overrides = BASE + [
        "model_engine=hdp",
        "actor_rollout_ref.actor.hdp.max_tokens_per_rank=8192",
        "actor_rollout_ref.actor.hdp.group_shape=pow2",
        "actor_rollout_ref.actor.hdp.zero_memory=level1",
        "actor_rollout_ref.actor.megatron.expert_model_parallel_size=2",
    ]
    cfg = _compose("ppo_trainer", overrides)
    assert cfg.actor_rollout_ref.actor.strategy == "hdp"
    actor = omega_conf_to_dataclass(cfg.actor_rollout_ref.actor)
    ref = _ref_config(cfg)
    for c in (actor, ref):
        assert isinstance(c, HdpActorConfig)
        assert isinstance(c.engine, HdpEngineConfig) and c.engine.strategy == "hdp"
        assert c.engine.hdp.max_tokens_per_rank == 8192
        assert c.engine.hdp.group_shape.value == "pow2"
        assert c.engine.hdp.zero_memory.value == "level1"
        assert c.engine.expert_model_parallel_size == 2
        assert _engine_cls(c.engine) is HdpMegatronEngine
    assert ref.engine.forward_only and not actor.engine.forward_only
    _validate(cfg)


def test_hdp_ppo_trainer_config_name():
    cfg = _compose("hdp_ppo_trainer", BASE, config_path=config_dir())
    actor = omega_conf_to_dataclass(cfg.actor_rollout_ref.actor)
    assert isinstance(actor, HdpActorConfig) and _engine_cls(actor.engine) is HdpMegatronEngine
    _validate(cfg)


def test_bad_options_name_the_field():
    with pytest.raises(ValueError, match=r"actor_rollout_ref\.actor\.hdp\.policy='nope'"):
        HdpOptions(policy="nope")
    with pytest.raises(ValueError, match=r"max_tokens_per_rank=0"):
        HdpOptions(max_tokens_per_rank=0)
    with pytest.raises(ValueError, match=r"megatron\.context_parallel_size=4"):
        HdpEngineConfig(context_parallel_size=4)
    with pytest.raises(ValueError, match=r"strategy='megatron'"):
        HdpEngineConfig(strategy="megatron")
    with pytest.raises(ValueError, match=r"hdp.max_tokens_per_rank=None: this device has no memory limit"):
        HdpOptions().token_budgets(None, None)
    assert HdpOptions().token_budgets(4096, None) == (4096, 4096)
    assert HdpOptions().token_budgets(4096, 8192) == (4096, 8192)
    assert HdpOptions(max_tokens_per_rank=100).token_budgets(4096, 8192) == (100, 100)


def test_plugin_registration_is_idempotent():
    from verl.workers.engine import EngineRegistry

    before = dict(EngineRegistry._engines["language_model"]["hdp"])
    assert plugin.register() and plugin.register()
    assert plugin.register_engines() == []
    assert EngineRegistry._engines["language_model"]["hdp"] == before
    assert set(before) == {"cuda", "npu", "cpu"}
    assert all(getattr(c, "_hdp_lazy", False) and c.resolve() is HdpMegatronEngine for c in before.values())


def test_engine_keeps_the_domain_built_by_the_parent_constructor(monkeypatch):
    """verl's MegatronEngine.__init__ calls _init_device_mesh, which builds hdp's domain; __init__ keeps it.

    (It used to reset ``_domain`` to None afterwards, so every real construction failed in the
    worker's ``is_mp_src_rank_with_outputs``.)
    """
    from hdp.integrations.verl import engine as E

    sentinel = object()
    monkeypatch.setattr(E._MegatronLM, "__init__", lambda self, *a, **k: self._init_device_mesh())
    monkeypatch.setattr(E.HdpMegatronEngine, "_init_device_mesh", lambda self: setattr(self, "_domain", sentinel))
    eng = E.HdpMegatronEngine(
        model_config=None, engine_config=HdpEngineConfig(), optimizer_config=None, checkpoint_config=None
    )
    assert eng.domain is sentinel


def test_float32_engine_dtype_is_accepted():
    assert HdpEngineConfig(dtype="float32").dtype == "float32"
    assert HdpEngineConfig().dtype == "bfloat16"


def test_round_targets_follow_verls_alignment():
    """The verl loss adapter packs ``next_token_targets`` with each round's layout: position p predicts
    token p+1 of its sample (verl's no_padding_2_padding alignment), the pad id after the last."""
    from hdp.dispatch import local_meta, pack
    from hdp.packing import PlannerConfig, plan
    from hdp.core.rounds import next_token_targets

    samples = [torch.arange(10, 10 + n) for n in (9, 4, 12)]
    targets = next_token_targets(samples, 0)
    p = plan([9, 4, 12], PlannerConfig(num_ranks=2, max_tokens_per_rank=12))
    seen = {}
    for r in range(p.num_rounds):
        for rank in range(2):
            meta = local_meta(p, rank, r)
            if not meta.num_tokens:
                continue
            tokens, tgt = pack(meta, samples), pack(meta, targets)
            for t in range(meta.num_tokens):
                s, pos = int(meta.sample_index[t]), int(meta.position_ids[t])
                assert int(tokens[t]) == int(samples[s][pos])
                assert int(tgt[t]) == (int(samples[s][pos + 1]) if pos + 1 < len(samples[s]) else 0)
                seen[(s, pos)] = seen.get((s, pos), 0) + 1
    assert seen == {(s, i): 1 for s, x in enumerate(samples) for i in range(len(x))}


def test_metric_shapes_are_verls_engines_shapes():
    """The whole mini-batch's metrics (`VerlLoss.whole_metrics`) in the shapes of verl's own engines: one ``Metric``
    per name with verl's aggregation, plain numbers as a list; verl's DP aggregation over hdp's one-rank DP group
    returns each value unchanged (the values themselves: tests/distributed/verl/test_verl_conformance.py, every metric
    against the
    mini-batch's own)."""
    from verl.utils.metric.utils import AggregationType, Metric

    out = metric_shapes({"actor/pg_loss": Metric(AggregationType.SUM, 1.2),
                         "actor/pg_clipfrac": Metric(AggregationType.MEAN, 0.2),
                         "rollout_corr/rollout_is_max": Metric(AggregationType.MAX, 3.0), "kl_coef": 0.5})
    assert isinstance(out["actor/pg_loss"], Metric) and isinstance(out["actor/pg_clipfrac"], Metric)
    assert out["rollout_corr/rollout_is_max"].aggregation is AggregationType.MAX
    assert Metric.aggregate_dp([out["actor/pg_loss"]]) == pytest.approx(1.2)
    assert Metric.aggregate_dp([out["actor/pg_clipfrac"]]) == pytest.approx(0.2)
    assert Metric.aggregate_dp([out["rollout_corr/rollout_is_max"]]) == pytest.approx(3.0)
    assert out["kl_coef"] == [0.5]


@pytest.mark.parametrize(
    ("model_kw", "engine_kw", "match"),
    [
        ({"mtp": {"enable": True}}, {}, r"mtp\.enable=True"),
        ({"vision": True}, {}, r"multimodal"),
        ({"fused_kernel_options": {"impl_backend": "triton"}}, {"use_fused_kernels": True},
         r"fused_kernel_options\.impl_backend='triton'"),
        ({}, {"override_transformer_config": {"calculate_per_token_loss": True}}, r"calculate_per_token_loss=True"),
    ],
)
def test_dropped_parent_features_are_rejected_at_construction(monkeypatch, model_kw, engine_kw, match):
    """MTP, multimodal, verl's triton / liger fused kernels and the per-token-loss regime fail naming the setting
    (router replay runs: tests/slow/verl/test_verl_router_replay.py; ``use_fused_kernels=True`` runs hdp's fused
    log-prob
    path: tests/unit/verl/test_verl_fused_logprobs.py tests/slow/verl/test_verl_fused_logprobs_slow.py)."""
    from types import SimpleNamespace

    from hdp.integrations.verl import engine as E

    monkeypatch.setattr(E._MegatronLM, "__init__", lambda self, *a, **k: None)
    model = SimpleNamespace(
        mtp=SimpleNamespace(**model_kw.get("mtp", {"enable": False})),
        hf_config=SimpleNamespace(vision_config={} if model_kw.get("vision") else None),
        fused_kernel_options=model_kw.get("fused_kernel_options", {"impl_backend": "torch"}),
    )
    eng_cfg = HdpEngineConfig()
    for k, v in engine_kw.items():
        if k == "router_replay":
            object.__setattr__(eng_cfg.router_replay, "mode", v["mode"])
        else:
            object.__setattr__(eng_cfg, k, v)
    with pytest.raises(ValueError, match=match):
        E.HdpMegatronEngine(model_config=model, engine_config=eng_cfg, optimizer_config=None, checkpoint_config=None)


# ---- verl configuration errors name the verl key; all before any collective ----


def test_hdp_options_without_model_engine_hdp_name_the_override():
    """strategy=hdp on verl's ppo_trainer has no actor.hdp node; Hydra's "Key 'hdp' is not in struct" now
    says to add model_engine=hdp (through Hydra's real override path: compose)."""
    from hydra.errors import ConfigCompositionException

    bad = "actor_rollout_ref.actor.hdp.max_tokens_per_rank=8192"
    with pytest.raises(ConfigCompositionException, match=r"model_engine=hdp") as err:
        _compose("ppo_trainer", BASE + ["actor_rollout_ref.actor.strategy=hdp", bad])
    assert bad in str(err.value)
    # the override the message names makes the same line work
    cfg = _compose("ppo_trainer", BASE + ["model_engine=hdp", bad])
    assert omega_conf_to_dataclass(cfg.actor_rollout_ref.actor).engine.hdp.max_tokens_per_rank == 8192
    # other bad overrides keep Hydra's own message
    with pytest.raises(ConfigCompositionException, match=r"Could not override 'actor_rollout_ref.actor.nope'"):
        _compose("ppo_trainer", BASE + ["actor_rollout_ref.actor.strategy=hdp", "actor_rollout_ref.actor.nope=1"])


@pytest.mark.parametrize("engine", ["strategy=hdp", "model_engine=hdp"])
@pytest.mark.parametrize("value", [0, -5])
def test_nonpositive_ppo_max_token_len_names_the_key(engine, value):
    switch = "actor_rollout_ref.actor.strategy=hdp" if engine == "strategy=hdp" else "model_engine=hdp"
    cfg = _compose("ppo_trainer", BASE + [switch, f"actor_rollout_ref.actor.ppo_max_token_len_per_gpu={value}"])
    want = rf"actor_rollout_ref\.actor\.ppo_max_token_len_per_gpu={value}:.*positive integer.*hdp\.max_tokens_per_rank"
    with pytest.raises((ValueError, Exception), match=want):
        _validate(cfg)  # verl's validate_config: the actor config is built and checked there
    if engine == "model_engine=hdp":  # hdp's own budget makes verl's irrelevant
        ok = _compose("ppo_trainer", BASE + [switch, f"actor_rollout_ref.actor.ppo_max_token_len_per_gpu={value}",
                                             "actor_rollout_ref.actor.hdp.max_tokens_per_rank=4096"])
        _validate(ok)


def test_bad_ref_megatron_value_names_the_ref_key():
    cfg = _compose("ppo_trainer", BASE + ["model_engine=hdp", "actor_rollout_ref.ref.megatron.context_parallel_size=2"])
    omega_conf_to_dataclass(cfg.actor_rollout_ref.actor)  # the actor is fine
    with pytest.raises(Exception, match=r"actor_rollout_ref\.ref\.megatron\.context_parallel_size=2") as err:
        _ref_config(cfg)
    assert "actor_rollout_ref.actor.megatron" not in str(err.value)
    cfg = _compose("ppo_trainer", BASE + ["model_engine=hdp", "actor_rollout_ref.ref.megatron.expert_model_parallel_size=0"])
    with pytest.raises(Exception, match=r"actor_rollout_ref\.ref\.megatron\.expert_model_parallel_size=0: pass a positive"):
        _ref_config(cfg)


@pytest.mark.parametrize(
    ("key", "value"),
    [
        ("tensor_model_parallel_size", 0),
        ("pipeline_model_parallel_size", -1),
        ("expert_model_parallel_size", 0),
        ("expert_tensor_parallel_size", 0),
    ],
)
def test_nonpositive_parallel_sizes_name_the_actor_key(key, value):
    cfg = _compose("ppo_trainer", BASE + ["model_engine=hdp", f"actor_rollout_ref.actor.megatron.{key}={value}"])
    with pytest.raises(Exception, match=rf"actor_rollout_ref\.actor\.megatron\.{key}={value}: pass a positive integer"):
        omega_conf_to_dataclass(cfg.actor_rollout_ref.actor)


def test_tp_pp_ep_are_taken_from_verls_megatron_config():
    layout = [
        "actor_rollout_ref.actor.megatron.tensor_model_parallel_size=2",
        "actor_rollout_ref.actor.megatron.pipeline_model_parallel_size=4",
        "actor_rollout_ref.actor.megatron.expert_model_parallel_size=2",
    ]
    cfg = _compose("ppo_trainer", BASE + ["model_engine=hdp"] + layout)
    for c in (omega_conf_to_dataclass(cfg.actor_rollout_ref.actor), _ref_config(cfg)):  # the ref follows the actor
        e = c.engine
        assert (e.tensor_model_parallel_size, e.pipeline_model_parallel_size, e.expert_model_parallel_size) == (2, 4, 2)
        assert e.sequence_parallel  # verl's default under TP; the engine pads packed lengths to a multiple of TP
    assert HdpEngineConfig(pipeline_model_parallel_size=4, virtual_pipeline_model_parallel_size=2)  # interleaved
    with pytest.raises(ValueError, match=r"megatron\.virtual_pipeline_model_parallel_size=2: virtual stages need "
                                         r".*pipeline_model_parallel_size >= 2"):
        HdpEngineConfig(virtual_pipeline_model_parallel_size=2)


@pytest.mark.parametrize("key", ["actor_rollout_ref.actor.ulysses_sequence_parallel_size",
                                 "actor_rollout_ref.actor.fsdp_config.ulysses_sequence_parallel_size"])
def test_ulysses_under_hdp_names_the_key(key):
    cfg = _compose("ppo_trainer", BASE + ["actor_rollout_ref.actor.strategy=hdp", f"{key}=2"])
    with pytest.raises(Exception, match=r"ulysses_sequence_parallel_size=2: .*set it to 1"):
        _validate(cfg)
    # on the engine path too (the converter), naming the engine's key
    from verl.workers.config import FSDPEngineConfig

    with pytest.raises(ValueError, match=r"actor_rollout_ref\.actor\.fsdp_config\.ulysses_sequence_parallel_size=2"):
        to_hdp_engine_config(FSDPEngineConfig(ulysses_sequence_parallel_size=2, strategy="fsdp"))


@pytest.mark.parametrize("engine", ["strategy=hdp", "model_engine=hdp"])
def test_use_remove_padding_false_names_the_key(engine):
    switch = "actor_rollout_ref.actor.strategy=hdp" if engine == "strategy=hdp" else "model_engine=hdp"
    cfg = _compose("ppo_trainer", BASE + [switch, "actor_rollout_ref.model.use_remove_padding=false"])
    with pytest.raises(Exception, match=r"actor_rollout_ref\.model\.use_remove_padding=False: .*set it to True"):
        _validate(cfg)


def test_engine_construction_checks_name_the_verl_keys(monkeypatch):
    """What the worker fills in after config time is checked when the engine is constructed (before
    Megatron's initialisation, i.e. before any collective)."""
    from types import SimpleNamespace

    from hdp.integrations.verl import engine as E

    called = []
    monkeypatch.setattr(E._MegatronLM, "__init__", lambda self, *a, **k: called.append(1))
    model = SimpleNamespace(mtp=SimpleNamespace(enable=False), hf_config=SimpleNamespace(vision_config=None),
                            use_remove_padding=True)

    def build(model_cfg, **engine_kw):
        eng = HdpEngineConfig()
        for k, v in engine_kw.items():
            object.__setattr__(eng, k, v)
        E.HdpMegatronEngine(model_config=model_cfg, engine_config=eng, optimizer_config=None, checkpoint_config=None)

    with pytest.raises(ValueError, match=r"actor_rollout_ref\.model\.use_remove_padding=False"):
        build(SimpleNamespace(**{**vars(model), "use_remove_padding": False}))
    with pytest.raises(ValueError, match=r"actor_rollout_ref\.actor\.ppo_max_token_len_per_gpu=0"):
        build(model, max_token_len_per_gpu=0, infer_max_token_len_per_gpu=64)
    with pytest.raises(ValueError, match=r"actor_rollout_ref\.rollout\.log_prob_max_token_len_per_gpu=-1"):
        build(model, max_token_len_per_gpu=64, infer_max_token_len_per_gpu=-1)
    with pytest.raises(ValueError, match=r"actor_rollout_ref\.ref\.log_prob_max_token_len_per_gpu=0"):
        build(model, forward_only=True, infer_max_token_len_per_gpu=0)
    assert not called  # every check ran before verl's constructor (Megatron, collectives)
    build(model, max_token_len_per_gpu=64, infer_max_token_len_per_gpu=64)
    assert called == [1]


def test_zero_memory_under_tp_needs_expert_tp_1():
    """verl leaves expert TP null (Megatron: = TP); hdp's MoE zero-memory recomputes whole experts."""
    common = BASE + ["model_engine=hdp", "actor_rollout_ref.actor.hdp.zero_memory=level1",
                     "actor_rollout_ref.actor.megatron.tensor_model_parallel_size=2"]
    cfg = _compose("ppo_trainer", common)
    with pytest.raises(Exception, match=r"actor_rollout_ref\.actor\.megatron\.expert_tensor_parallel_size=None "
                                        r"\(expert TP 2.*set actor_rollout_ref\.actor\.megatron\.expert_tensor_parallel_size=1"):
        omega_conf_to_dataclass(cfg.actor_rollout_ref.actor)
    ok = _compose("ppo_trainer", common + ["actor_rollout_ref.actor.megatron.expert_tensor_parallel_size=1"])
    assert omega_conf_to_dataclass(ok.actor_rollout_ref.actor).engine.expert_tensor_parallel_size == 1
    assert _ref_config(ok).engine.expert_tensor_parallel_size == 1  # the ref follows the actor


def test_memory_limit_options_name_the_verl_key(monkeypatch):
    """``hdp.max_memory_gb``: bad values at configuration time; a limit below the layout's static memory
    when the engine is constructed, before verl's constructor (Megatron, collectives)."""
    from types import SimpleNamespace

    from hdp.integrations.verl import engine as E

    with pytest.raises(ValueError, match=r"actor_rollout_ref\.actor\.hdp\.max_memory_gb=-2: pass GB per device"):
        HdpOptions(max_memory_gb=-2)
    with pytest.raises(ValueError, match=r"actor_rollout_ref\.actor\.hdp\.measure_memory='yes'"):
        HdpOptions(measure_memory="yes")
    called = []
    monkeypatch.setattr(E._MegatronLM, "__init__", lambda self, *a, **k: called.append(1))
    qwen3 = SimpleNamespace(vision_config=None, model_type="qwen3", num_hidden_layers=28, hidden_size=1024,
                            num_attention_heads=16, num_key_value_heads=8, head_dim=128, intermediate_size=3072,
                            vocab_size=151936, hidden_act="silu")
    model = SimpleNamespace(mtp=SimpleNamespace(enable=False), hf_config=qwen3, use_remove_padding=True)
    eng = HdpEngineConfig(hdp=HdpOptions(max_memory_gb=0.5))
    object.__setattr__(eng, "max_token_len_per_gpu", 64)
    object.__setattr__(eng, "infer_max_token_len_per_gpu", 64)
    with pytest.raises(ValueError, match=r"actor_rollout_ref\.actor\.hdp\.max_memory_gb=0\.5 GB per device is below "
                                         r"the static memory of qwen3.*raise the limit or shard more"):
        E.HdpMegatronEngine(model_config=model, engine_config=eng, optimizer_config=None, checkpoint_config=None)
    assert not called
    from hdp.integrations.verl.memory import verl_memory

    mm, limit = verl_memory(model, dataclasses.replace(eng, hdp=HdpOptions(max_memory_gb=80)), world=8,
                            device=torch.device("cpu"))
    assert limit == 80 * 2**30 and mm.layout.domain == 8 and mm.shape.num_layers == 28
    assert mm.token_budget(limit) > 1000  # a 0.6B-parameter model leaves room on 80 GB


def test_megatron_groups_of_the_verl_engine_get_hdps_timeout(monkeypatch):
    """verl initialises Megatron without a timeout (torch's 30 minutes); the hdp engine builds the same groups first,
    with verl's own arguments (read off verl's ``_init_device_mesh`` run on the same config) plus
    ``hdp.collective_timeout_s``, and verl's ``_init_device_mesh`` then finds them built.  No patch of Megatron."""
    from megatron.core import parallel_state

    from hdp.integrations.verl import engine as E

    def recorder(into):
        def initialize_model_parallel(*args, **kwargs):
            assert not args, args
            into.append(kwargs)
            monkeypatch.setattr(parallel_state, "is_initialized", lambda: True)

        return initialize_model_parallel

    layout = dict(tensor_model_parallel_size=2, pipeline_model_parallel_size=2, expert_model_parallel_size=2,
                  virtual_pipeline_model_parallel_size=2)
    stock, hdp = [], []
    monkeypatch.setattr(parallel_state, "is_initialized", lambda: False)
    monkeypatch.setattr(parallel_state, "initialize_model_parallel", recorder(stock))
    verl_engine = E._MegatronLM.__new__(E._MegatronLM)
    verl_engine.engine_config = HdpEngineConfig(**layout)
    E._MegatronLM._init_device_mesh(verl_engine)  # verl's own call, on the same layout

    monkeypatch.setattr(parallel_state, "is_initialized", lambda: False)
    monkeypatch.setattr(parallel_state, "initialize_model_parallel", recorder(hdp))
    monkeypatch.setattr(E.VerlDomain, "build", staticmethod(lambda *a, **k: None))
    monkeypatch.setattr(parallel_state, "get_data_parallel_group", lambda *a, **k: None)
    for getter, name in (("get_tensor_model_parallel_world_size", "tensor_model_parallel_size"),
                         ("get_pipeline_model_parallel_world_size", "pipeline_model_parallel_size"),
                         ("get_expert_model_parallel_world_size", "expert_model_parallel_size")):
        monkeypatch.setattr(parallel_state, getter, lambda *a, n=name, **k: layout[n])
    monkeypatch.setattr(E.mc, "megatron_groups", lambda: None)
    eng = E.HdpMegatronEngine.__new__(E.HdpMegatronEngine)
    eng.hdp_config = eng.engine_config = HdpEngineConfig(**layout, hdp=HdpOptions(collective_timeout_s=45))
    eng._init_device_mesh()
    assert len(stock) == 1 and len(hdp) == 1, (stock, hdp)  # verl's _init_device_mesh found hdp's groups built
    assert hdp[0] == {**stock[0], "distributed_timeout_minutes": 0.75}


def test_an_engine_built_on_another_engines_parallel_state_is_refused():
    """verl builds the critic's, the ref's and the actor's engines in one process: the first one builds Megatron's
    parallel state, and an engine whose layout differs is refused naming its key (its model would be cut for the
    other layout)."""
    from hdp.integrations.verl.checks import check_shared_layout

    built = {"tensor_model_parallel_size": 1, "pipeline_model_parallel_size": 2, "expert_model_parallel_size": 1}
    check_shared_layout(HdpEngineConfig(pipeline_model_parallel_size=2), built)
    with pytest.raises(ValueError, match=r"critic\.megatron\.pipeline_model_parallel_size=1: .*already built with "
                                         r"pipeline_model_parallel_size=2"):
        check_shared_layout(HdpEngineConfig(role="critic"), built)


@pytest.mark.parametrize(("overrides", "match"), [
    (["actor_rollout_ref.actor.use_dynamic_bsz=false", "actor_rollout_ref.rollout.log_prob_use_dynamic_bsz=false",
      "actor_rollout_ref.ref.log_prob_use_dynamic_bsz=false"],
     r"actor_rollout_ref\.actor\.use_dynamic_bsz=False: hdp packs every round by tokens.*2 x 1024 = 2048"),
    (["actor_rollout_ref.ref.megatron.context_parallel_size=4"], r"actor_rollout_ref\.ref\.megatron\.context_parallel_size=4"),
    (["algorithm.adv_estimator=gae", "critic.megatron.pipeline_model_parallel_size=2"],
     r"critic\.megatron\.pipeline_model_parallel_size=2 but actor_rollout_ref\.actor\.megatron\.pipeline_model_parallel_size=1"),
    (["actor_rollout_ref.actor.hdp.skip_old_log_prob=true", "actor_rollout_ref.actor.ppo_epochs=2"],
     r"skip_old_log_prob=true, but this job needs the old-log-prob pass: actor_rollout_ref\.actor\.ppo_epochs=2"),
    # 1 is true for the driver as for the option's check (it was read as auto: no error, the pass kept)
    (["actor_rollout_ref.actor.hdp.skip_old_log_prob=1", "algorithm.rollout_correction.rollout_is=token"],
     r"skip_old_log_prob=true, but this job needs the old-log-prob pass: .*algorithm\.rollout_correction\.rollout_is=token"),
])
def test_job_settings_spread_over_roles_fail_in_the_driver(overrides, match):
    """verl's validate_config (the driver, before Ray starts) refuses what hdp cannot honour, naming the key:
    use_dynamic_bsz=False, the ref's context parallelism (verl builds the ref's config only in the workers), a
    critic laid out unlike the actor it shares a process with, and skip_old_log_prob=true on an off-policy step."""
    cfg = _compose("ppo_trainer", BASE + ["model_engine=hdp", "actor_rollout_ref.actor.ppo_max_token_len_per_gpu=4096",
                                          "actor_rollout_ref.actor.megatron.vanilla_mbridge=true", *overrides])
    with pytest.raises(ValueError, match=match):
        _validate(cfg)


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory) -> str:
    """A tiny local HF model (verl's validation of a critic loads its model's config)."""
    from hdp.integrations.verl.scaffolding.tiny import build_tiny

    return str(build_tiny(tmp_path_factory.mktemp("tiny") / "model"))


@pytest.mark.parametrize(("overrides", "match"), [
    (["critic.use_dynamic_bsz=false", "critic.ppo_micro_batch_size_per_gpu=2"],
     r"critic\.use_dynamic_bsz=False: hdp packs every round by tokens.*critic\.ppo_micro_batch_size_per_gpu would be "
     r"ignored\); set use_dynamic_bsz=True and critic\.ppo_max_token_len_per_gpu .*2 x 1024 = 2048"),
    (["actor_rollout_ref.ref.log_prob_use_dynamic_bsz=false"],
     r"actor_rollout_ref\.ref\.log_prob_use_dynamic_bsz=False: hdp packs every round by tokens.*"
     r"actor_rollout_ref\.ref\.log_prob_micro_batch_size_per_gpu would be ignored.*2 x 1024 = 2048"),
], ids=["critic", "ref"])
def test_use_dynamic_bsz_false_fails_in_the_driver_for_every_role(overrides, match, tiny_model):
    """One rule for every role on hdp: the critic's and the ref's ``use_dynamic_bsz=False`` (their micro-batch
    sizes would be ignored) fails in the driver as the actor's does, naming the role's keys (the critic's
    used to run silently); the same job with dynamic batch sizes passes."""
    base = BASE + ["model_engine=hdp", "algorithm.adv_estimator=gae", f"actor_rollout_ref.model.path={tiny_model}",
                   f"critic.model.path={tiny_model}", "actor_rollout_ref.actor.ppo_max_token_len_per_gpu=4096",
                   "actor_rollout_ref.actor.megatron.vanilla_mbridge=true"]
    with pytest.raises(ValueError, match=match):
        _validate(_compose("ppo_trainer", base + overrides))
    fixed = _compose("ppo_trainer", base + [o.replace("=false", "=true") for o in overrides if "use_dynamic_bsz" in o])
    if verl_version().split("+")[0] == "0.9.0":  # then the critic's model building on this verl (last check)
        with pytest.raises(ValueError, match=r"critic\.megatron\.vanilla_mbridge=True with verl 0\.9\.0"):
            _validate(fixed)
        return
    _validate(fixed)


def test_a_critic_built_by_vanilla_mbridge_on_verl_090_fails_in_the_driver(monkeypatch, tiny_model):
    """verl 0.9.0 builds a value model's Megatron config with an argument megatron-core's TransformerConfig refuses
    (a TypeError deep in the worker, stock verl's critic alike): on 0.9.0 the driver refuses a critic on hdp built
    by vanilla mbridge, naming the key, the version and the fix (the version reading monkeypatched)."""
    import hdp.integrations.verl as V

    cfg = _compose("ppo_trainer", BASE + ["model_engine=hdp", "algorithm.adv_estimator=gae",
                                          f"actor_rollout_ref.model.path={tiny_model}", f"critic.model.path={tiny_model}",
                                          "actor_rollout_ref.actor.ppo_max_token_len_per_gpu=4096",
                                          "actor_rollout_ref.actor.megatron.vanilla_mbridge=true"])
    monkeypatch.setattr(V, "verl_version", lambda: "0.9.0")
    with pytest.raises(ValueError, match=r"critic\.megatron\.vanilla_mbridge=True with verl 0\.9\.0: .*"
                                         r"pip install 'verl==0\.9\.1'"):
        _validate(cfg)
    monkeypatch.setattr(V, "verl_version", lambda: "0.9.1")
    _validate(cfg)
