"""Zoo entries from `transformers` configs, with random weights (never downloaded).

Each entry is (config class, model class, input kind, small config, realistic config).
Small configs are for tests (hidden 32-64, 1-2 layers, short sequences, small images);
realistic ones are the config's defaults where those are a standard size, otherwise the
standard checkpoint's shape named in the comment (decoders at ~100-500M parameters, which
a CPU can run; their families' 7B defaults cannot). Decoders run with `use_cache=False`
and return transformers' ModelOutput (several models of transformers 5 fail with
`return_dict=False`).
"""
from __future__ import annotations

import importlib
from typing import Any

import torch

SEQ_SMALL, SEQ_REAL = 16, 128
VOCAB_SMALL = 1000
_ENC = dict(hidden_size=64, num_hidden_layers=1, num_attention_heads=4, intermediate_size=128,
            vocab_size=VOCAB_SMALL, max_position_embeddings=64)
_DEC = dict(hidden_size=64, num_hidden_layers=1, num_attention_heads=4, intermediate_size=128,
            vocab_size=VOCAB_SMALL, max_position_embeddings=64)
_LLAMA_REAL = dict(hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                   num_attention_heads=9, num_key_value_heads=3, vocab_size=49152,
                   max_position_embeddings=2048)  # SmolLM-135M
_DEBERTA = dict(relative_attention=True, position_buckets=256, pos_att_type=["p2c", "c2p"],
                max_relative_positions=-1, position_biased_input=False,
                norm_rel_ebd="layer_norm", share_att_key=True)

# name -> (config class, model class, inputs, small config, realistic config)
# inputs: "ids" (token ids), "image" (pixels), "audio" (raw waveform), "mel" (log-mel frames)
SPECS: dict[str, tuple[str, str, str, dict, dict]] = {
    # -- encoders --------------------------------------------------------------------------
    "distilbert": ("DistilBertConfig", "DistilBertModel", "ids",
                   dict(dim=64, n_layers=1, n_heads=4, hidden_dim=128, vocab_size=VOCAB_SMALL,
                        max_position_embeddings=64), {}),
    "roberta": ("RobertaConfig", "RobertaModel", "ids", dict(_ENC, max_position_embeddings=66),
                dict(vocab_size=50265, max_position_embeddings=514)),  # roberta-base
    "xlm-roberta": ("XLMRobertaConfig", "XLMRobertaModel", "ids",
                    dict(_ENC, max_position_embeddings=66),
                    dict(vocab_size=250002, max_position_embeddings=514)),  # xlm-roberta-base
    "albert": ("AlbertConfig", "AlbertModel", "ids", dict(_ENC, embedding_size=32),
               dict(hidden_size=768, num_attention_heads=12, intermediate_size=3072)),  # base
    "electra": ("ElectraConfig", "ElectraModel", "ids", dict(_ENC, embedding_size=32),
                {}),  # electra-small discriminator
    "deberta-v2": ("DebertaV2Config", "DebertaV2Model", "ids", dict(_ENC, **_DEBERTA),
                   dict(hidden_size=768, num_hidden_layers=12, num_attention_heads=12,
                        intermediate_size=3072, **_DEBERTA)),  # deberta-v3-base
    "mpnet": ("MPNetConfig", "MPNetModel", "ids", dict(_ENC, max_position_embeddings=66), {}),
    "t5-encoder": ("T5Config", "T5EncoderModel", "ids",
                   dict(d_model=64, d_kv=16, d_ff=128, num_layers=1, num_heads=4,
                        vocab_size=VOCAB_SMALL), {}),  # t5-small
    # -- decoders (use_cache=False) -----------------------------------------------------------
    "gpt2": ("GPT2Config", "GPT2Model", "ids",
             dict(n_embd=64, n_layer=1, n_head=4, n_positions=64, vocab_size=VOCAB_SMALL), {}),
    "gpt-neo": ("GPTNeoConfig", "GPTNeoModel", "ids",
                dict(hidden_size=64, num_layers=2, num_heads=4, window_size=8,
                     attention_types=[[["global", "local"], 1]], vocab_size=VOCAB_SMALL,
                     max_position_embeddings=64),
                dict(hidden_size=768, num_layers=12, num_heads=12,
                     attention_types=[[["global", "local"], 6]])),  # gpt-neo-125M
    "opt": ("OPTConfig", "OPTModel", "ids",
            dict(hidden_size=64, num_hidden_layers=1, num_attention_heads=4, ffn_dim=128,
                 word_embed_proj_dim=64, vocab_size=VOCAB_SMALL, max_position_embeddings=64),
            {}),  # opt-125m
    "llama": ("LlamaConfig", "LlamaModel", "ids", dict(_DEC, num_key_value_heads=2),
              _LLAMA_REAL),
    "mistral": ("MistralConfig", "MistralModel", "ids",
                dict(_DEC, num_key_value_heads=2, sliding_window=8),
                dict(_LLAMA_REAL, vocab_size=32000, sliding_window=4096)),
    "qwen2": ("Qwen2Config", "Qwen2Model", "ids", dict(_DEC, num_key_value_heads=2),
              dict(hidden_size=896, intermediate_size=4864, num_hidden_layers=24,
                   num_attention_heads=14, num_key_value_heads=2, vocab_size=151936)),  # 0.5B
    "phi": ("PhiConfig", "PhiModel", "ids", dict(_DEC, partial_rotary_factor=0.5),
            dict(hidden_size=1024, intermediate_size=4096, num_hidden_layers=12,
                 num_attention_heads=16, vocab_size=51200)),  # phi-1.5 shape at 12 layers
    "gemma": ("GemmaConfig", "GemmaModel", "ids",
              dict(_DEC, num_key_value_heads=1, head_dim=16),
              dict(hidden_size=640, intermediate_size=2048, num_hidden_layers=18,
                   num_attention_heads=4, num_key_value_heads=1, head_dim=256,
                   vocab_size=256000)),  # gemma-3-270m shape
    "bart": ("BartConfig", "BartModel", "ids",
             dict(d_model=64, encoder_layers=1, decoder_layers=1, encoder_attention_heads=4,
                  decoder_attention_heads=4, encoder_ffn_dim=128, decoder_ffn_dim=128,
                  vocab_size=VOCAB_SMALL, max_position_embeddings=64),
             dict(d_model=768, encoder_layers=6, decoder_layers=6, encoder_attention_heads=12,
                  decoder_attention_heads=12, encoder_ffn_dim=3072,
                  decoder_ffn_dim=3072)),  # bart-base
    # -- vision -------------------------------------------------------------------------------
    "deit": ("DeiTConfig", "DeiTModel", "image",
             dict(_ENC, image_size=32, patch_size=8), {}),  # deit-base 224
    "beit": ("BeitConfig", "BeitModel", "image",
             dict(_ENC, image_size=32, patch_size=8, use_relative_position_bias=True), {}),
    "dinov2": ("Dinov2Config", "Dinov2Model", "image",
               dict(_ENC, image_size=28, patch_size=14),
               dict(image_size=224)),  # dinov2-base
    "swin": ("SwinConfig", "SwinModel", "image",
             dict(image_size=32, patch_size=4, embed_dim=16, depths=[1, 1], num_heads=[2, 2],
                  window_size=4), {}),  # swin-tiny 224
    "convnext": ("ConvNextConfig", "ConvNextModel", "image",
                 dict(hidden_sizes=[16, 32], depths=[1, 1], num_stages=2, image_size=32),
                 {}),  # convnext-tiny
    "mobilevit": ("MobileViTConfig", "MobileViTModel", "image",
                  dict(image_size=64, hidden_sizes=[32, 32, 48],
                       neck_hidden_sizes=[8, 8, 16, 16, 24, 24, 64], num_attention_heads=2),
                  {}),  # mobilevit-small 256
    "segformer": ("SegformerConfig", "SegformerModel", "image",
                  dict(depths=[1, 1, 1, 1], hidden_sizes=[8, 16, 32, 48],
                       num_attention_heads=[1, 1, 2, 2], image_size=64),
                  dict(image_size=512)),  # mit-b0 at 512x512
    # its all-MLP decode head: each stage's features upsampled (bilinear) to a quarter of
    # the image, concatenated, fused, classified per pixel
    "segformer-seg": ("SegformerConfig", "SegformerForSemanticSegmentation", "image",
                      dict(depths=[1, 1, 1, 1], hidden_sizes=[8, 16, 32, 48],
                           num_attention_heads=[1, 1, 2, 2], image_size=64,
                           decoder_hidden_size=32, num_labels=4),
                      dict(image_size=512, num_labels=150)),  # mit-b0, ADE20k, 512x512
    "resnet18": ("ResNetConfig", "ResNetModel", "image",
                 dict(embedding_size=16, hidden_sizes=[16, 32], depths=[1, 1],
                      layer_type="basic", image_size=64),
                 dict(hidden_sizes=[64, 128, 256, 512], depths=[2, 2, 2, 2],
                      layer_type="basic")),
    "regnet": ("RegNetConfig", "RegNetModel", "image",
               dict(embedding_size=16, hidden_sizes=[16, 32], depths=[1, 1], groups_width=8,
                    image_size=64), {}),  # regnet-y-040
    "efficientnet": ("EfficientNetConfig", "EfficientNetModel", "image",
                     dict(image_size=64, width_coefficient=0.25, depth_coefficient=0.25,
                          hidden_dim=320),
                     dict(image_size=224, width_coefficient=1.0, depth_coefficient=1.0,
                          hidden_dim=1280)),  # efficientnet-b0
    "mobilenet-v2": ("MobileNetV2Config", "MobileNetV2Model", "image",
                     dict(image_size=64, depth_multiplier=0.25), {}),  # 1.0 224
    # -- audio --------------------------------------------------------------------------------
    "wav2vec2": ("Wav2Vec2Config", "Wav2Vec2Model", "audio",
                 dict(_ENC, conv_dim=[16, 16, 16], conv_stride=[5, 2, 2], conv_kernel=[10, 3, 3],
                      num_conv_pos_embeddings=16, num_conv_pos_embedding_groups=4), {}),
    "hubert": ("HubertConfig", "HubertModel", "audio",
               dict(_ENC, conv_dim=[16, 16, 16], conv_stride=[5, 2, 2], conv_kernel=[10, 3, 3],
                    num_conv_pos_embeddings=16, num_conv_pos_embedding_groups=4), {}),
    "whisper-encoder": ("WhisperConfig", "WhisperEncoder", "mel",
                        dict(d_model=64, encoder_layers=1, encoder_attention_heads=4,
                             encoder_ffn_dim=128, num_mel_bins=16, max_source_positions=32),
                        {}),  # whisper-tiny: 80 mels, 3000 frames
}


def _classes(config_name: str, model_name: str):
    import transformers

    if model_name == "WhisperEncoder":
        module = importlib.import_module("transformers.models.whisper.modeling_whisper")
        return transformers.WhisperConfig, module.WhisperEncoder
    return getattr(transformers, config_name), getattr(transformers, model_name)


def _inputs(kind: str, config: Any, small: bool) -> tuple[torch.Tensor, ...]:
    if kind == "ids":
        return (torch.randint(0, config.vocab_size, (1, SEQ_SMALL if small else SEQ_REAL)),)
    if kind == "image":
        side = getattr(config, "image_size", 224)
        side = side if isinstance(side, int) else side[0]
        return (torch.randn(1, config.num_channels, side, side),)
    if kind == "audio":
        return (torch.randn(1, 1600 if small else 16000),)  # 0.1 s or 1 s at 16 kHz
    return (torch.randn(1, config.num_mel_bins, 2 * config.max_source_positions),)


def build(name: str, small: bool):
    """(module in eval mode, inputs, notes) for zoo entry `name`."""
    config_name, model_name, kind, small_config, real_config = SPECS[name]
    config_cls, model_cls = _classes(config_name, model_name)
    config = config_cls(**(small_config if small else real_config))
    if hasattr(config, "use_cache"):
        config.use_cache = False
    module = model_cls(config).eval()
    inputs = _inputs(kind, config, small)
    shape = "x".join(str(d) for d in inputs[0].shape[1:])
    return module, inputs, f"{model_name}, input {shape}"
