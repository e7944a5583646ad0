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

    return mc.TransformerConfig(num_layers=1, hidden_size=32, num_attention_heads=4, attention_dropout=0.0, **kw)


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
        ({}, {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64},
         r"rope_parameters\.rope_type='yarn'"),
        ({"rotary_base": 1e4}, {}, r"rope_theta=1000000\.0 but the Megatron model was built with rotary_base=10000\.0"),
        ({"position_embedding_type": "mrope"}, {}, r"position_embedding_type='mrope'"),
        ({"rotary_scaling": True}, {}, r"rope_scaling=True"),
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
