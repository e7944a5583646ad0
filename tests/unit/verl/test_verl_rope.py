"""hdp's RoPE in the verl engine comes from the built Megatron model and the HF config, or raises.

``_install_hdp_attention`` used to read ``hf_config.rope_theta`` and silently fall back to 10000
(transformers 5 keeps the base in ``rope_parameters``) and ignored ``rotary_percent``, YaRN and
interleaving.  Checked here on transformers' own ``Qwen3Config`` and a Megatron ``TransformerConfig``.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest

pytest.importorskip("verl")

from transformers import Qwen3Config  # noqa: E402

from hdp.integrations.verl.rope import hf_rope_parameters, rope_config  # noqa: E402


def _tf(**kw):
    from hdp import megatron_compat as mc

    return mc.TransformerConfig(**{"num_layers": 1, "hidden_size": 32, "num_attention_heads": 4, "attention_dropout": 0.0,
                                   **kw})


def _model(tf=None, **kw):
    attrs = dict(position_embedding_type="rope", rotary_base=1e6, rotary_percent=1.0, rotary_scaling=False,
                 rotary_pos_emb=SimpleNamespace(seq_len_interpolation_factor=None), config=tf or _tf())
    attrs.update(kw)
    return SimpleNamespace(**attrs)


def _hf(**rope):
    params = {"rope_type": "default", "rope_theta": 1e6, **rope}
    return Qwen3Config(vocab_size=16, hidden_size=32, num_hidden_layers=1, num_attention_heads=4,
                       num_key_value_heads=2, head_dim=8, intermediate_size=64, rope_parameters=params)


def test_transformers5_config_keeps_theta_in_rope_parameters():
    hf = _hf()
    assert getattr(hf, "rope_theta", None) is None  # the attribute the old code read
    assert hf_rope_parameters(hf)["rope_theta"] == 1e6
    cfg = rope_config(_model(), hf)
    assert cfg.base == 1e6 and cfg.percent == 1.0 and cfg.enabled


def test_install_hdp_attention_uses_the_models_base():
    """The engine's layer swap: the installed core attention rotates with base 1e6 (old code: 10000)."""
    from hdp.integrations.verl.attention import install_hdp_attention

    tf = _tf()
    layers = [SimpleNamespace(self_attention=SimpleNamespace(core_attention=SimpleNamespace(config=tf, layer_number=i + 1)))
              for i in range(2)]
    model = _model(tf, decoder=SimpleNamespace(layers=layers))
    install_hdp_attention(model, _hf())
    for layer in layers:
        assert layer.self_attention.core_attention.rope.base == 1e6
    assert model.position_embedding_type == "none"  # Megatron's own RoPE is off: no double rotation


def test_partial_rotary_factor():
    assert rope_config(_model(rotary_percent=0.5), _hf(partial_rotary_factor=0.5)).percent == 0.5
    with pytest.raises(ValueError, match=r"partial_rotary_factor=0\.5 but Megatron rotary_percent=1\.0"):
        rope_config(_model(), _hf(partial_rotary_factor=0.5))


@pytest.mark.parametrize(
    ("model_kw", "hf_kw", "match"),
    [
        ({}, {"rope_type": "longrope", "factor": 4.0, "original_max_position_embeddings": 64,
              "short_factor": [1.0] * 4, "long_factor": [1.0] * 4}, r"rope_parameters\.rope_type='longrope'"),
        ({}, {"mrope_section": [1, 1, 2]}, r"rope_parameters\.mrope_section=\[1, 1, 2\]"),
        ({"rotary_base": 1e4}, {}, r"rope_theta=1000000\.0 but the Megatron model was built with rotary_base=10000\.0"),
        ({"position_embedding_type": "mrope"}, {}, r"position_embedding_type='mrope'"),
        ({"rotary_scaling": True}, {}, r"rope_scaling=True \(Llama 3\) but hf_config\.rope_parameters\.rope_type='default'"),
        ({"rotary_pos_emb": SimpleNamespace(seq_len_interpolation_factor=2.0)}, {}, r"seq_len_interpolation_factor=2\.0"),
    ],
)
def test_unsupported_rope_raises_naming_the_field(model_kw, hf_kw, match):
    with pytest.raises(ValueError, match=match):
        rope_config(_model(**model_kw), _hf(**hf_kw))


def test_interleaved_raises():
    with pytest.raises(ValueError, match="rotary_interleaved=True"):
        rope_config(_model(_tf(rotary_interleaved=True)), _hf())


def test_no_position_embedding_means_no_rope():
    assert not rope_config(_model(position_embedding_type="none"), None).enabled


# ---- frequency variants: the HF config's, exactly (mbridge's translation may lose them) ----------------------


def _llama3_hf():
    from transformers import LlamaConfig

    return LlamaConfig(vocab_size=16, hidden_size=32, num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2,
                       max_position_embeddings=1024,
                       rope_parameters={"rope_type": "llama3", "rope_theta": 1e6, "factor": 8.0, "low_freq_factor": 1.0,
                                        "high_freq_factor": 4.0, "original_max_position_embeddings": 64})


def test_llama3_from_hf_over_mbridges_linear_factor():
    """mbridge's Llama bridge builds Megatron with seq_len_interpolation_factor = the Llama-3 factor (linear
    scaling of every frequency): hdp computes HF's llama3 instead."""
    from hdp.rope import RopeType

    mega = _model(rotary_pos_emb=SimpleNamespace(seq_len_interpolation_factor=8.0))
    cfg = rope_config(mega, _llama3_hf())
    s = cfg.scaling
    assert s.type is RopeType.LLAMA3 and (s.factor, s.low_freq_factor, s.high_freq_factor) == (8.0, 1.0, 4.0)
    assert s.original_max_position_embeddings == 64


def test_yarn_from_hf_with_transformers_defaults():
    from hdp.rope import RopeType

    cfg = rope_config(_model(), _hf(rope_type="yarn", factor=4.0, original_max_position_embeddings=32))
    s = cfg.scaling
    assert s.type is RopeType.YARN and s.factor == 4.0 and s.original_max_position_embeddings == 32
    assert (s.beta_fast, s.beta_slow, s.truncate, s.attention_factor) == (32.0, 1.0, True, None)
    assert abs(s.attention_scale - (0.1 * __import__("math").log(4.0) + 1)) < 1e-12


def test_dynamic_takes_the_fixed_length_and_refuses_longer_samples():
    import torch

    from hdp.rope import RopeType, rope_cos_sin

    cfg = rope_config(_model(), _hf(rope_type="dynamic", factor=2.0))
    assert cfg.scaling.type is RopeType.DYNAMIC and cfg.scaling.max_positions == 32768  # Qwen3Config's default
    rope_cos_sin(torch.tensor([0, 32767]), 8, scaling=cfg.scaling)
    with pytest.raises(ValueError, match="reaches position 32768 but rope_type dynamic"):
        rope_cos_sin(torch.tensor([5, 32768]), 8, scaling=cfg.scaling)


def test_megatron_alone_linear_and_llama3():
    from hdp.rope import RopeType

    lin = rope_config(_model(rotary_pos_emb=SimpleNamespace(seq_len_interpolation_factor=2.0)), None)
    assert lin.scaling.type is RopeType.LINEAR and lin.scaling.factor == 2.0
    with pytest.raises(ValueError, match=r"rope_scaling=True \(Llama 3\) without an HF config"):
        rope_config(_model(rotary_scaling=True), None)


# ---- attention settings: HF windows filled in where mbridge drops them, conflicts refused -------------------


def _qwen2(**kw):
    from transformers import Qwen2Config

    return Qwen2Config(vocab_size=16, hidden_size=32, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
                       **kw)


def test_hf_sliding_window_applied_when_megatron_has_none():
    from hdp.integrations.verl.attention import attention_settings

    hf = _qwen2(use_sliding_window=True, sliding_window=6, max_window_layers=2)  # layers 3, 4 slide
    s = attention_settings(_tf(num_layers=4), hf)
    assert [s.window_for(layer) for layer in (1, 2, 3, 4)] == [None, None, 5, 5]
    assert attention_settings(_tf(num_layers=4), _qwen2()).window is None  # use_sliding_window=False: none


def test_megatron_window_must_match_hf():
    from hdp.integrations.verl.attention import attention_settings

    hf = _qwen2(use_sliding_window=True, sliding_window=6, max_window_layers=0)
    ok = attention_settings(_tf(num_layers=4, window_size=(5, 0)), hf)
    assert [ok.window_for(layer) for layer in (1, 2, 3, 4)] == [5, 5, 5, 5]
    with pytest.raises(ValueError, match=r"window_size=\(7, 0\).*gives \[5, 5, 5, 5\]"):
        attention_settings(_tf(num_layers=4, window_size=(7, 0)), hf)


def test_hf_attention_fields_hdp_does_not_compute_are_refused():
    from hdp.integrations.verl.attention import attention_settings

    hf = _qwen2()
    hf.attn_logit_softcapping = 50.0
    with pytest.raises(ValueError, match=r"hf_config\.attn_logit_softcapping=50\.0"):
        attention_settings(_tf(num_layers=4), hf)
    hf = _qwen2()
    hf.query_pre_attn_scalar = 4.0
    with pytest.raises(ValueError, match=r"query_pre_attn_scalar=4\.0 scales the logits by 0\.5"):
        attention_settings(_tf(num_layers=4), hf)
    assert attention_settings(_tf(num_layers=4, softmax_scale=0.5), hf).softmax_scale == 0.5
